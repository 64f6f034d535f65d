"""Groups of 32 inputs with a scale and a min each: the loader's exact form and cpu_native's, rows interleaved or not.

- `GroupedWeight` is the loader's exact form of a block-quantized matrix (GGUF Q4_0, Q4_1,
  Q4_K's groups, Q8_0, GPTQ/AWQ): unsigned integers, a scale and a min per group.
- `BlockWeight`: 4- and 8-bit groups of 32 in the order of cpu_native's `block_matmul`
  (nanoinfer/backends/cpu/cpu_native_groups.h). Where the build reads them so, its rows go in
  groups of 16 (`BlockWeight.interleave`, cpu_native_groups_rows16.h): each group's rows cut in
  4-byte units (4 values of one group of 32, and on 4 bits the 4 of the step 4 later) stored unit
  by unit, a chunk's units group by group, the 16 rows' copies of a unit together; its scales and
  mins [group][16 rows]. A vector load is then one unit of 16 rows, and one vpdpbusd adds 4
  products to each row's lane. The last rows % 16 stay as they are; the permutation only moves
  bytes, so the tensors keep their shapes. A symmetric format's mins (Q4_0's -8 d) are then not
  kept: the kernel derives them.

nanoinfer.quant.quantized holds their matmuls and references beside the other forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupedWeight:
    """w[r, c] = scale[r, c // group] * q[r, c] + min[r, c // group], q in [0, 2**bits)."""

    q: torch.Tensor  # [out, in] uint8
    scale: torch.Tensor  # [out, in // group] fp32
    min: torch.Tensor  # [out, in // group] fp32
    bits: int  # 4 or 8
    # Which input each stored column is (GPTQ's act-order, its inputs reordered so that each
    # group's are contiguous: w[r, cols[c]] is the formula's); None: column c is input c.
    cols: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def rows(self, index) -> "GroupedWeight":
        """The rows at `index` (a permutation, a slice...), still quantized."""
        return GroupedWeight(self.q[index], self.scale[index], self.min[index], self.bits, self.cols)

    @staticmethod
    def cat(parts: list["GroupedWeight"]) -> "GroupedWeight":
        """Rows stacked, as torch.cat of the dense matrices would (parts of equal bits, and
        of one column order: None from `concat_rows` otherwise)."""
        cols = parts[0].cols
        return GroupedWeight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "min")), parts[0].bits,
                             cols)


def block_chunks(groups: int) -> list[int]:
    """How BlockWeight splits a row of `groups` groups: 8 at a time, then 4, 2, 1 as needed."""
    sizes = [8] * (groups // 8)
    return sizes + [g for g in (4, 2, 1) if groups % 8 & g]


@dataclass(frozen=True)
class BlockWeight:
    """Groups of 32 in cpu_native.c's chunk order: w[r, c] = scale[r, g] * q[r, c] + min[r, g].

    A row is chunks of G groups (`block_chunks`). In a chunk, value 4 s + i of group j (step
    s of 8, i of 4) is byte 4 (G s + j) + i; for 4 bits the chunk's 16 G bytes hold the first
    half of that order in their low nibbles and the second half in their high ones. Each
    32-byte load is then four values of each of the chunk's groups, and the kernel sums a
    group in one integer lane (cpu_native.c says more). `interleave` lays the rows out for the
    one-token kernel of CPUs whose build reads them so (the module's docstring)."""

    q: torch.Tensor  # [out, in * bits / 8] uint8
    scale: torch.Tensor  # [out, in // 32] fp16
    # [out, in // 32] fp16; None (interleaved only): -2^(bits - 1) * scale, a symmetric format's (Q4_0, Q8_0), which
    # the kernel derives instead of reading a tenth more bytes
    min: torch.Tensor | None
    bits: int  # 4 or 8
    interleaved: int = 0  # rows a group of `interleave`'s layout, or 0: the file's

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 8 // self.bits

    @staticmethod
    def from_groups(w: GroupedWeight) -> "BlockWeight":
        if w.group != 32:
            raise ValueError(f"block_matmul takes groups of 32, not {w.group}")
        out, parts, start = w.shape[0], [], 0
        for size in block_chunks(w.shape[1] // 32):
            chunk = w.q[:, 32 * start:32 * (start + size)].reshape(out, size, 8, 4).transpose(1, 2).reshape(out, -1)
            if w.bits == 4:
                chunk = chunk[:, :16 * size] | chunk[:, 16 * size:] << 4
            parts.append(chunk)
            start += size
        return BlockWeight(torch.cat(parts, dim=1).contiguous(), w.scale.to(torch.float16), w.min.to(torch.float16),
                           w.bits)

    def interleave(self, group: int) -> "BlockWeight":
        """This weight with its rows in groups of `group` (the module's docstring); its rows must be whole
        chunks of 8 groups."""
        if self.interleaved or self.shape[1] % 256:
            raise ValueError(f"cannot interleave a BlockWeight of {self.shape[1]} columns interleaved by "
                             f"{self.interleaved} (expected whole chunks of 256 columns, in the file's layout)")
        q = torch.empty_like(self.q, memory_format=torch.contiguous_format)
        file, laid = _unit_views(self.q, q, group, self.bits)
        # (copy_ from the permuted view: no temporary the size of the matrix, which the allocator would keep)
        laid.copy_(file.permute(0, 2, 4, 3, 1, 5))
        q[file.shape[0] * group:] = self.q[file.shape[0] * group:]
        symmetric = torch.equal(self.min.float(), self.scale.float() * -(1 << (self.bits - 1)))
        return BlockWeight(q, interleave_rows(self.scale, group), None if symmetric else interleave_rows(self.min, group),
                           self.bits, group)

    def file_layout(self) -> "BlockWeight":
        """This weight with `interleave` undone."""
        if not self.interleaved:
            return self
        group, q = self.interleaved, torch.empty_like(self.q, memory_format=torch.contiguous_format)
        file, laid = _unit_views(q, self.q, group, self.bits)  # (q: the file's layout to fill)
        file.copy_(laid.permute(0, 4, 1, 3, 2, 5))
        q[file.shape[0] * group:] = self.q[file.shape[0] * group:]
        scale = interleave_rows(self.scale, group, undo=True)
        mins = scale * -(1 << (self.bits - 1)) if self.min is None else interleave_rows(self.min, group, undo=True)  # (exact)
        return BlockWeight(q, scale, mins, self.bits)

    def groups(self) -> GroupedWeight:
        """The inverse of `from_groups` (scales and mins in fp32)."""
        if self.interleaved:
            return self.file_layout().groups()
        out, cols = self.shape
        parts, offset = [], 0
        for size in block_chunks(cols // 32):
            chunk = self.q[:, offset:offset + 4 * self.bits * size]
            offset += chunk.shape[1]
            if self.bits == 4:
                chunk = torch.cat((chunk & 15, chunk >> 4), dim=1)
            parts.append(chunk.reshape(out, 8, size, 4).transpose(1, 2).reshape(out, -1))
        return GroupedWeight(torch.cat(parts, dim=1).contiguous(), self.scale.float(), self.min.float(), self.bits)


def _unit_views(file: torch.Tensor, laid: torch.Tensor, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q's whole groups of rows as [groups, row, chunk, step, group of 32, 4] in the file's order (a chunk's
    4-byte unit 8 s + j: group j's step s) and as [groups, chunk, group of 32, step, row, 4] in the interleaved one."""
    rows, row_bytes = file.shape
    whole, steps = rows // group * group, bits  # (a group of 32's units in a chunk: 4 on 4 bits, 8 on 8)
    return (file[:whole].view(-1, group, row_bytes // (32 * bits), steps, 8, 4),
            laid[:whole].view(-1, row_bytes // (32 * bits), 8, steps, group, 4))


def interleave_rows(t: torch.Tensor, group: int, undo: bool = False) -> torch.Tensor:
    """`t` [rows, cols] (a BlockWeight's scales or mins) with its rows in groups of `group`, each group stored
    column by column, the group's rows' values of a column together; the last rows % group as they are.
    `undo`: the inverse."""
    rows, cols = t.shape
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    whole = rows // group * group
    laid, file = (-1, cols, group), (-1, group, cols)
    src, dst = (laid, file) if undo else (file, laid)
    out[:whole].view(dst).copy_(t[:whole].view(src).transpose(1, 2))
    out[whole:] = t[whole:]
    return out
