"""Check a GGUF file's header against its size before gguf-py parses it.

gguf-py's GGUFReader trusts every count and length in a header: it loops once per declared
array item, building numpy views as it goes, so 73 bytes that declare 2^60 items eat memory
without end (issue 59), and a tensor's dimensions multiply in uint64, wrapping silently.
`check_gguf_header` walks the header with `struct` over the memory-mapped file, holding
nothing but the names it has seen, and refuses with one CheckpointError naming the file and
the field whatever the file cannot hold (a count, a length, a tensor's bytes), whatever
llama.cpp refuses too (arrays of arrays, more than 4 dimensions, an unknown type, a misaligned
tensor), and headers past the budgets below, so that what the reader then builds is bounded.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from nanoinfer.errors import CheckpointError

# gguf-py builds about a kilobyte of numpy views per key or array item (measured: 0.7 KB per
# UINT8, 1.6 KB per string, ~25 µs each), so a few megabytes of real items would cost it
# gigabytes. The largest real headers hold ~1.3M (Gemma 3: 262k tokens, their scores and
# types, 515k merges); past this budget a header is refused rather than read.
MAX_METADATA_ITEMS = 1 << 21  # keys and array items together
MAX_TENSORS = 1 << 16  # ~5 KB each in gguf-py; real models hold a few thousand
MAX_DIMS = 4  # GGML_MAX_DIMS

_SCALARS = {  # struct formats of GGUF's fixed-size values
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_STRING_BYTES = 8  # a string is its uint64 length, then its bytes
_MIN_KV_BYTES = _STRING_BYTES + 4 + 1  # an empty key, its value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = _STRING_BYTES + 4 + 8 + 4 + 8  # an empty name, n_dims, one dimension, type, offset


class _Header:
    """A read position in the mapped file; each read checked against the bytes left."""

    def __init__(self, path: Path, data: mmap.mmap):
        self.path, self.data, self.at, self.order = path, data, 0, "<"

    def left(self) -> int:
        return len(self.data) - self.at

    def corrupt(self, problem: str) -> CheckpointError:
        return CheckpointError(self.path, f"truncated or corrupt GGUF file: {problem}")

    def need(self, size: int, what: str) -> None:
        if size > self.left():
            raise self.corrupt(f"{what} needs {size} bytes at offset {self.at}, where the file holds "
                               f"{self.left()} more")

    def skip(self, size: int, what: str) -> None:
        self.need(size, what)
        self.at += size

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.at)
        self.at += size
        return value

    def string(self, what: str) -> str:
        length = self.scalar("Q", f"the length of {what}")
        self.need(length, what)
        raw = self.data[self.at:self.at + length]
        self.at += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:  # (gguf-py decodes names and values as UTF-8)
            raise self.corrupt(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar("I", f"the value type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.corrupt(f"{what}: value type {raw}, which GGUF does not define "
                               f"(0 to {max(GGUFValueType)})") from None


def check_gguf_header(path: Path) -> None:
    """Raise CheckpointError naming `path` and the field unless its header describes what the
    file holds, within the budgets above; reads only the header (the file is mapped)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                f.seek(0)
                raise CheckpointError(path, f"not a GGUF file: it begins with {f.read(4)!r}, not b'GGUF'")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _check(_Header(path, data))
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the file: {exc}") from exc


def _check(header: _Header) -> None:
    header.skip(4, "the magic")
    version = header.scalar("I", "the version")
    if version & 0xFFFF == 0:  # (written on a big-endian machine: gguf-py reads it byte-swapped too)
        header.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in READER_SUPPORTED_VERSIONS:
        raise CheckpointError(header.path, f"GGUF version {version} is not supported (expected one of "
                                           f"{sorted(READER_SUPPORTED_VERSIONS)})")
    tensor_count = header.scalar("Q", "the tensor count")
    kv_count = header.scalar("Q", "the metadata key count")
    if kv_count > header.left() // _MIN_KV_BYTES:
        raise header.corrupt(f"it declares {kv_count} metadata keys, but the {header.left()} bytes after its "
                             f"counts hold at most {header.left() // _MIN_KV_BYTES}")
    if tensor_count > header.left() // _MIN_TENSOR_INFO_BYTES:
        raise header.corrupt(f"it declares {tensor_count} tensors, but the {header.left()} bytes after its counts "
                             f"hold at most {header.left() // _MIN_TENSOR_INFO_BYTES}")
    if tensor_count > MAX_TENSORS:
        raise CheckpointError(header.path, f"it declares {tensor_count} tensors, past the {MAX_TENSORS} this loader "
                                           "reads (real models hold a few thousand)")
    alignment = _check_metadata(header, kv_count)
    _check_tensors(header, tensor_count, alignment)


def _check_metadata(header: _Header, kv_count: int) -> int:
    """Walk the key/value pairs; return the file's alignment."""
    keys, items, alignment = set(), kv_count, GGUF_DEFAULT_ALIGNMENT
    for index in range(kv_count):
        key = header.string(f"the name of metadata key {index}")
        if key in keys:
            raise header.corrupt(f"metadata key {key!r} appears twice")
        keys.add(key)
        what = f"metadata key {key!r}"
        kind = header.value_type(what)
        if kind == GGUFValueType.ARRAY:
            item = header.value_type(f"the items of {what}")
            if item == GGUFValueType.ARRAY:  # (gguf-py would recurse; llama.cpp refuses them)
                raise header.corrupt(f"{what} is an array of arrays, which GGUF readers do not take")
            count = header.scalar("Q", f"the length of {what}")
            least = count * (_STRING_BYTES if item == GGUFValueType.STRING else struct.calcsize(_SCALARS[item]))
            header.need(least, f"{what}, {count} {item.name} items,")
            items += count
            if items > MAX_METADATA_ITEMS:
                raise CheckpointError(header.path, f"{what} holds {count} items, taking the metadata past the "
                                                   f"{MAX_METADATA_ITEMS} keys and array items this loader reads "
                                                   "(the largest real vocabularies come to ~1.3M)")
            if item == GGUFValueType.STRING:
                for i in range(count):
                    header.string(f"item {i} of {what}")
            else:
                header.skip(least, what)
        elif kind == GGUFValueType.STRING:
            header.string(what)
        else:
            value = header.scalar(_SCALARS[kind], what)
            if key == "general.alignment":
                alignment = value
        if key == "general.alignment" and kind != GGUFValueType.UINT32:
            raise header.corrupt(f"general.alignment is a {kind.name}, expected a UINT32 (as gguf-py reads it)")
        if key == "general.alignment" and (alignment < 1 or alignment & (alignment - 1)):
            raise header.corrupt(f"general.alignment is {alignment}: expected a power of two")
    return alignment


def _check_tensors(header: _Header, tensor_count: int, alignment: int) -> None:
    """Walk the tensor infos; each tensor must lie, aligned, inside the data section."""
    names, spans = set(), []
    for index in range(tensor_count):
        name = header.string(f"the name of tensor {index}")
        if name in names:
            raise header.corrupt(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = header.scalar("I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise header.corrupt(f"tensor {name!r} has {n_dims} dimensions (expected 1 to {MAX_DIMS})")
        dims = [header.scalar("Q", f"the dimensions of tensor {name!r}") for _ in range(n_dims)]
        if min(dims) < 1:
            raise header.corrupt(f"tensor {name!r} has dimensions {dims}: expected each at least 1")
        raw_type = header.scalar("I", f"the type of tensor {name!r}")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise header.corrupt(f"tensor {name!r} has ggml type {raw_type}, which gguf-py does not know") from None
        if dims[0] % block:
            raise header.corrupt(f"tensor {name!r} ({ggml_type.name}) has rows of {dims[0]} values, not a multiple "
                                 f"of its {block}-value blocks")
        offset = header.scalar("Q", f"the offset of tensor {name!r}")
        spans.append((name, ggml_type, dims, offset, math.prod(dims) // block * block_bytes))
    data_start = -(-header.at // alignment) * alignment
    data_bytes = max(0, len(header.data) - data_start)
    for name, ggml_type, dims, offset, nbytes in spans:
        if offset % alignment:
            raise header.corrupt(f"tensor {name!r} starts at offset {offset} of the data section, not a multiple "
                                 f"of the alignment {alignment}")
        if offset + nbytes > data_bytes:
            raise header.corrupt(f"tensor {name!r} ({ggml_type.name}, dimensions {dims}) needs {nbytes} bytes at "
                                 f"offset {offset} of the data section, which holds {data_bytes}")
