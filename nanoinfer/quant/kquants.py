"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) kept in their super-block form: the weight, its reference, its matmul's reference.

A `KQuantWeight` holds a matrix's bytes as the file stores them, one row of 256-wide
super-blocks after another (ggml's block_q4_K, block_q5_K, block_q6_K), so loading rounds
nothing: Q4_K's and Q5_K's sub-block scales are products of an fp16 and a 6-bit integer that
fp16 need not hold. `dequantize` reads the blocks from the formats' definitions (tested against
gguf-py's dequantizer). cpu_native.c's `kquant_matmul` multiplies them in integers with the
activations rounded as llama.cpp's Q8_K rounds them (one fp32 scale per 256, 127 at the
largest magnitude); `reference_kquant_matmul` is that computation in torch ops, bit for bit.
A fused matrix whose parts have different types (Q4_K_M's Q4_K q/k with a Q6_K v) is a
`StackedWeight` of its parts, each multiplied in its own form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256
# ggml's type ids (GGMLQuantizationType) and a super-block's bytes
Q4_K, Q5_K, Q6_K = 12, 13, 14
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}
NAMES = {Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}


@dataclass(frozen=True)
class KQuantWeight:
    """A [rows, cols] matrix as GGUF's K-quant super-blocks, cols a multiple of 256."""

    data: torch.Tensor  # [rows, cols // 256 * BLOCK_BYTES[qtype]] uint8, the file's bytes (in `interleave`'s order)
    qtype: int  # Q4_K, Q5_K or Q6_K
    cols: int
    interleaved: int = 0  # rows a group of `interleave`'s layout, or 0: the file's

    def __post_init__(self):
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"not a K-quant type id: {self.qtype} (expected one of {sorted(NAMES.values())})")
        if self.cols % QK_K or self.data.shape[1] != self.cols // QK_K * BLOCK_BYTES[self.qtype]:
            raise ValueError(f"{NAMES[self.qtype]} rows of {self.cols} take {self.cols // QK_K} super-blocks of "
                             f"{BLOCK_BYTES[self.qtype]} bytes (cols a multiple of 256), not {self.data.shape[1]} bytes")

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    def rows(self, index) -> "KQuantWeight":
        """The rows at `index` (a slice or ids), in this weight's layout."""
        if not self.interleaved:
            return KQuantWeight(self.data[index], self.qtype, self.cols)
        return interleave(self.file_rows(torch.arange(self.data.shape[0])[index]), self.interleaved)

    def file_rows(self, ids: torch.Tensor) -> "KQuantWeight":
        """Rows `ids` in the file's layout, reading only their bytes (an embedding table's few a step)."""
        ids = ids.reshape(-1)
        if not self.interleaved:
            return KQuantWeight(self.data[ids], self.qtype, self.cols)
        return KQuantWeight(_file_rows(self, ids), self.qtype, self.cols)


def _views(data: torch.Tensor, qtype: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three views of the rows of `data` that go in groups of `group`: in the file's order [groups, row, block,
    byte], and in `interleave`'s, its units [groups, block, unit, row, 4] and the blocks' bytes past their
    units [groups, block, row, bytes]."""
    (rows, row_bytes), bytes_ = data.shape, BLOCK_BYTES[qtype]
    groups, blocks, units = rows // group, row_bytes // bytes_, bytes_ // 4
    flat = data[:groups * group].reshape(groups, group * row_bytes)
    return (flat.view(groups, group, blocks, bytes_),
            flat[:, :blocks * units * group * 4].unflatten(1, (blocks, units, group, 4)),
            flat[:, blocks * units * group * 4:].unflatten(1, (blocks, group, bytes_ % 4)))


# Q6_K's units in the order kq16_block reads them: the 4 scale units (file units 48-51), then for each half h of
# the super-block and each u of its 8 steps, the two ql units and the qh unit that make its values (16h + u,
# 16h + 8 + u, 32 + 8h + u). In the file's order those reads jumped between three places a super-block, which the
# hardware prefetcher did not follow (11 GB/s from DRAM without software prefetches, ~30 with them); in this order
# they are one sequential stream: 5-18% faster from DRAM on a Zen 4, AVX2 and AVX-512 (bench/RESULTS.md).
Q6_K_UNITS = (48, 49, 50, 51) + tuple(unit for h in range(2) for u in range(8)
                                      for unit in (16 * h + u, 16 * h + 8 + u, 32 + 8 * h + u))


def unit_order(qtype: int) -> tuple[int, ...] | None:
    """The file's unit stored at each place of a super-block in `interleave`'s layout (None: the file's order)."""
    return Q6_K_UNITS if qtype == Q6_K else None


def interleave(w: KQuantWeight, group: int = 16) -> KQuantWeight:
    """`w` laid out as cpu_native_kquants_rows16.h's kernels read it: the rows in groups of `group`
    (the last rows % group stay as they are), and within a group each super-block's bytes cut in
    4-byte units and stored unit by unit (Q6_K's in `Q6_K_UNITS`' order), the group's rows' copies of a unit
    together, super-block after super-block; the 2 bytes a Q6_K block has past its units (d) after all the
    group's units, [block][row]. A group keeps the file's bytes: the matrix keeps its shape."""
    if w.interleaved:
        raise ValueError(f"already interleaved by {w.interleaved}")
    out = torch.empty_like(w.data, memory_format=torch.contiguous_format)
    (file, _, _), (_, body, tail) = _views(w.data, w.qtype, group), _views(out, w.qtype, group)
    units = body.shape[2]
    # (copy_ from the permuted views: no temporary the size of the matrix, which the allocator would keep)
    stored = file[..., :4 * units].unflatten(-1, (units, 4)).permute(0, 2, 3, 1, 4)
    order = unit_order(w.qtype)
    if order is None:
        body.copy_(stored)
    else:
        for place, unit in enumerate(order):
            body[:, :, place].copy_(stored[:, :, unit])
    tail.copy_(file[..., 4 * units:].permute(0, 2, 1, 3))
    grouped = file.shape[0] * group
    out[grouped:] = w.data[grouped:]
    return KQuantWeight(out, w.qtype, w.cols, group)


def file_layout(w: KQuantWeight) -> KQuantWeight:
    """`w` in the file's layout (interleave undone)."""
    if not w.interleaved:
        return w
    group, out = w.interleaved, torch.empty_like(w.data, memory_format=torch.contiguous_format)
    (_, body, tail), (file, _, _) = _views(w.data, w.qtype, group), _views(out, w.qtype, group)
    units = body.shape[2]
    target, source = file[..., :4 * units].unflatten(-1, (units, 4)), body.permute(0, 3, 1, 2, 4)
    order = unit_order(w.qtype)
    if order is None:
        target.copy_(source)
    else:
        for place, unit in enumerate(order):
            target[..., unit, :].copy_(source[..., place, :])
    file[..., 4 * units:].copy_(tail.permute(0, 2, 1, 3))
    grouped = file.shape[0] * group
    out[grouped:] = w.data[grouped:]
    return KQuantWeight(out, w.qtype, w.cols)


def _file_rows(w: KQuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (1-D) of an interleaved `w` in the file's layout [len(ids), row_bytes]: a row's units
    are evenly strided through its group, so each is one strided copy (a few torch ops a row; Q6_K's
    then put back in the file's order)."""
    group, (rows, row_bytes), bytes_ = w.interleaved, w.data.shape, BLOCK_BYTES[w.qtype]
    blocks, units, rest = row_bytes // bytes_, bytes_ // 4, bytes_ % 4
    flat = w.data.reshape(-1)
    out = torch.empty(len(ids), row_bytes, dtype=torch.uint8)
    blocked = out.view(len(ids), blocks, bytes_)
    order = unit_order(w.qtype)
    if order is not None:  # (the place of each of the file's units)
        places = torch.empty(len(order), dtype=torch.int64)
        places[list(order)] = torch.arange(len(order))
    for i, row in enumerate(ids.tolist()):
        if row >= rows // group * group:  # (the last rows % group, as the file has them)
            out[i] = w.data[row]
            continue
        start = flat.storage_offset() + row // group * group * row_bytes  # (its group's first byte)
        stored = flat.as_strided((blocks, units, 4), (4 * units * group, 4 * group, 1), start + 4 * (row % group))
        if order is not None:
            stored = stored[:, places]
        blocked[i, :, :4 * units] = stored.flatten(1)
        if rest:  # (Q6_K's d: after the group's units, [block][row])
            blocked[i, :, 4 * units:] = flat.as_strided((blocks, rest), (group * rest, 1),
                                                        start + 4 * units * blocks * group + rest * (row % group))
    return out


@dataclass(frozen=True)
class StackedWeight:
    """Rows of differently quantized parts stacked (a fused q/k/v or gate/up of mixed types):
    the output of each part, concatenated."""

    parts: tuple  # of weights, each [rows_i, cols]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]


def _blocks(w: KQuantWeight) -> torch.Tensor:
    """[rows, blocks, bytes] int32 in the file's layout (shifts and masks below need a wider type than uint8)."""
    w = file_layout(w)
    return w.data.reshape(w.data.shape[0], -1, BLOCK_BYTES[w.qtype]).to(torch.int32)


def _f16(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (lo | hi << 8).to(torch.int16).view(torch.float16).float()


def scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 scale bytes [..., 12] -> 6-bit scales and mins [..., 8] (ggml's
    get_scale_min_k4: the first four whole in bytes 0-7, the last four split over bytes 8-11
    and the top bits of 0-7)."""
    low = torch.cat((s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6) << 4), dim=-1)
    mins = torch.cat((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4), dim=-1)
    return low, mins


def fields(w: KQuantWeight) -> dict[str, torch.Tensor]:
    """The super-blocks' fields, unpacked: q [rows, blocks, 256] unsigned values in order; d
    [rows, blocks] fp32; Q4_K/Q5_K: sc, m [rows, blocks, 8] and dmin; Q6_K: sc [rows, blocks,
    16] signed (q's offset is 32)."""
    b = _blocks(w)
    if w.qtype in (Q4_K, Q5_K):
        sc, m = scale_min_k4(b[..., 4:16])
        qs = b[..., 16:] if w.qtype == Q4_K else b[..., 48:]
        qs = qs.unflatten(-1, (4, 32))  # 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high
        q = torch.stack((qs & 15, qs >> 4), dim=-2).flatten(-3)
        if w.qtype == Q5_K:  # bit 4 of value i of sub-block j: bit j of qh[i]
            qh = b[..., 16:48]
            q = q | torch.stack([(qh >> j & 1) << 4 for j in range(8)], dim=-2).flatten(-2)
        return {"q": q, "d": _f16(b[..., 0], b[..., 1]), "dmin": _f16(b[..., 2], b[..., 3]), "sc": sc, "m": m}
    ql, qh = b[..., :128].unflatten(-1, (2, 64)), b[..., 128:192].unflatten(-1, (2, 32))
    # each half of 128: values 0-31 and 32-63 in ql's low nibbles, 64-127 in the high; 2 bits each from qh
    low = torch.cat((ql & 15, ql >> 4), dim=-1)  # [.., 2, 128]
    high = torch.cat([qh >> 2 * g & 3 for g in range(4)], dim=-1)
    q = (low | high << 4).flatten(-2)
    sc = b[..., 192:208].to(torch.int8).to(torch.int32)
    return {"q": q, "d": _f16(b[..., 208], b[..., 209]), "sc": sc}


def dequantize(w: KQuantWeight) -> torch.Tensor:
    """The fp32 matrix the blocks stand for (ggml's dequantize_row_q*_K)."""
    f = fields(w)
    rows = w.data.shape[0]
    if w.qtype == Q6_K:
        scale = f["d"][..., None] * f["sc"].float()  # [rows, blocks, 16]
        return (scale[..., None] * (f["q"] - 32).float().unflatten(-1, (16, 16))).reshape(rows, -1)
    scale, low = f["d"][..., None] * f["sc"].float(), f["dmin"][..., None] * f["m"].float()
    return (scale[..., None] * f["q"].float().unflatten(-1, (8, 32)) - low[..., None]).reshape(rows, -1)


def quantize_rows_q8k(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [tokens, k] as cpu_native.c's quantize_q8k rounds them: per 256, xq =
    round(x * (127 / amax)) (half to even) and xd = amax / 127, in fp32 -> (xq [tokens, blocks,
    256] float64 of integers, xd [tokens, blocks] fp32)."""
    x = rows.float().unflatten(1, (-1, QK_K))
    amax = x.abs().amax(dim=-1, keepdim=True)
    # (a tensor over a tensor: `127 / amax` is computed as 127 * (1 / amax), which rounds twice)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)
    return torch.round(x * inv).double(), (amax / 127)[..., 0]


def reference_kquant_matmul(rows: torch.Tensor, w: KQuantWeight) -> torch.Tensor:
    """What cpu_native's `kquant_matmul` computes, fp32, bit for bit: each super-block's sum in
    integers (float64 here: exact at these sizes), then per super-block in fp32, in order,
    acc += (xd * d) * sumi - (xd * dmin) * summ (Q6_K: acc += (xd * d) * sumi)."""
    xq, xd = quantize_rows_q8k(rows)
    f = fields(w)
    q, d = f["q"].double(), f["d"]
    if w.qtype == Q6_K:  # sumi = sum_s sc_s (x_s . q_s - 32 sum x_s), s over 16 values
        xs = xq.unflatten(-1, (16, 16))
        dots = torch.einsum("tbsi,rbsi->trbs", xs, q.unflatten(-1, (16, 16)))
        sumi = ((dots - 32 * xs.sum(-1)[:, None]) * f["sc"].double()[None]).sum(-1)
        terms = [(xd[:, None, b] * d[None, :, b]) * sumi[..., b].float() for b in range(d.shape[1])]
    else:  # sumi = sum_j sc_j x_j . q_j, summ = sum_j m_j sum x_j, j over 8 sub-blocks of 32
        xs = xq.unflatten(-1, (8, 32))
        sumi = (torch.einsum("tbji,rbji->trbj", xs, q.unflatten(-1, (8, 32))) * f["sc"].double()[None]).sum(-1)
        summ = torch.einsum("tbj,rbj->trb", xs.sum(-1), f["m"].double())
        terms = [(xd[:, None, b] * d[None, :, b]) * sumi[..., b].float()
                 - (xd[:, None, b] * f["dmin"][None, :, b]) * summ[..., b].float() for b in range(d.shape[1])]
    acc = torch.zeros(rows.shape[0], w.data.shape[0])
    for term in terms:
        acc = acc + term
    return acc
