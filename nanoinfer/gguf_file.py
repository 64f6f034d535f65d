"""Read a GGUF file's header, checked against its size: metadata values and tensor infos.

gguf-py's GGUFReader trusts every count and length in a header (it loops once per declared
array item: 73 bytes that declare 2^60 items eat memory without end, issue 59) and builds about
a kilobyte of numpy views per key or array item (the default model's header: +160 MB, ~2.5 s).
`read_gguf` walks the header once with `struct` over the memory-mapped file, checks each count,
length, type and offset against the bytes left before it reads what they describe, and builds
little: a numeric array or a tensor's data is a numpy view of the mapping (no copy), and only
keys and strings become Python objects (~100 bytes at most each, for at least 8 in the file).
Whatever the file cannot hold, whatever llama.cpp refuses too (arrays of arrays, more than 4
dimensions, an unknown type, a misaligned tensor), and headers past the budgets below are one
CheckpointError naming the file and the field.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Union

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from nanoinfer.errors import CheckpointError

# Keys and strings are the header's only Python objects (a numeric array is a view, of any
# length): past ~4M of them (~400 MB at worst) a header is refused rather than read, since its
# tokenizer would then build a vocabulary entry for each too. Real headers hold under 1M
# (vocabularies of up to 262k tokens, up to ~0.5M merges).
MAX_METADATA_OBJECTS = 1 << 22
MAX_TENSORS = 1 << 16  # ~0.5 KB of Python objects each; real models hold a few thousand
MAX_DIMS = 4  # GGML_MAX_DIMS

_SCALARS = {  # struct formats of GGUF's fixed-size values
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_NUMPY = {kind: np.dtype(fmt) for kind, fmt in _SCALARS.items()}  # (struct's letters are numpy's too)
# The tensor types gguf-py views as numbers; every other type as its raw bytes, [..., bytes per row].
_NUMERIC_TENSORS = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_STRING_BYTES = 8  # a string is its uint64 length, then its bytes
_MIN_KV_BYTES = _STRING_BYTES + 4 + 1  # an empty key, its value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = _STRING_BYTES + 4 + 8 + 4 + 8  # an empty name, n_dims, one dimension, type, offset

# A metadata value: a scalar as Python's int, float, bool or str; an array of strings as a list;
# a numeric array as a read-only numpy view of the file, in the file's byte order.
MetadataValue = Union[int, float, bool, str, list, np.ndarray]


class TensorInfo(NamedTuple):
    """One tensor of a GGUF file, as gguf-py's ReaderTensor describes it."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: the innermost (a row's length) first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    # A read-only view of the file, in numpy's order: [rows..., row] numbers for F16, F32, F64 and the
    # integer types, [rows..., bytes per row] uint8 for the others (block types, BF16).
    data: np.ndarray


_REQUIRED = object()  # GGUFFile's typed getters: no default, so a missing key is an error


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's header as `read_gguf` read it: its metadata (in the file's order) and its
    tensors, whose data are views over the mapped file (the mapping lives as long as they do)."""

    path: Path
    fields: Mapping[str, MetadataValue]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int  # where the data section starts

    # Typed reads: a key holding another kind of value is a CheckpointError naming the file and
    # the key; a missing key is `default`, or an error when there is none. An empty array is an
    # array of any kind (its item type tells nothing: writers pick one, and gguf-py gave [] for any).

    def scalar(self, key: str, default: Any = _REQUIRED) -> Any:
        """Any single value (not an array)."""
        return self._typed(key, default, "a single value", lambda v: not isinstance(v, (list, np.ndarray)))

    def string(self, key: str, default: Any = _REQUIRED) -> str:
        return self._typed(key, default, "a string", lambda v: isinstance(v, str))

    def integer(self, key: str, default: Any = _REQUIRED) -> int:
        return self._typed(key, default, "an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))

    def flag(self, key: str, default: Any = _REQUIRED) -> bool:
        return self._typed(key, default, "a bool", lambda v: isinstance(v, bool))

    def strings(self, key: str, default: Any = _REQUIRED) -> list[str]:
        return self._typed(key, default, "an array of strings", lambda v: isinstance(v, list), [])

    def integers(self, key: str, default: Any = _REQUIRED) -> np.ndarray:
        return self._typed(key, default, "an array of integers",
                           lambda v: isinstance(v, np.ndarray) and v.dtype.kind in "iu", np.empty(0, np.int32))

    def numbers(self, key: str, default: Any = _REQUIRED) -> np.ndarray:
        return self._typed(key, default, "an array of numbers",
                           lambda v: isinstance(v, np.ndarray) and v.dtype.kind in "iuf", np.empty(0, np.float32))

    def _typed(self, key: str, default: Any, expected: str, fits: Callable[[Any], bool], empty: Any = None) -> Any:
        """`empty`: what an empty array reads as, for the array reads."""
        if key not in self.fields:
            if default is _REQUIRED:
                raise CheckpointError(self.path, f"GGUF metadata key {key!r} is missing")
            return default
        value = self.fields[key]
        if empty is not None and isinstance(value, (list, np.ndarray)) and len(value) == 0:
            return empty
        if not fits(value):
            raise CheckpointError(self.path, f"GGUF metadata key {key!r} is {describe(value)}: expected {expected}")
        return value


def describe(value: MetadataValue) -> str:
    """A metadata value in a few words, on one line."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.size} {value.dtype.name}"
    if isinstance(value, list):
        return f"an array of {len(value)} strings"
    if isinstance(value, str):
        return f"the string {value[:40] + '...' if len(value) > 40 else value!r}"
    return f"the {type(value).__name__} {value!r}"


def read_gguf(path: Path) -> GGUFFile:
    """`path`'s header, or a CheckpointError naming `path` and the field unless it describes
    what the file holds, within the budgets above. Reads only the header (the file is mapped)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                f.seek(0)
                raise CheckpointError(path, f"not a GGUF file: it begins with {f.read(4)!r}, not b'GGUF'")
            # (not closed here: the tensors' views keep the mapping, which closes when the last goes)
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the file: {exc}") from exc
    return _read(_Header(path, mapped))


class _Header:
    """A read position in the mapped file; each read checked against the bytes left."""

    def __init__(self, path: Path, mapped: mmap.mmap):
        self.path, self.data, self.at, self.order = path, mapped, 0, "<"
        self.bytes = np.frombuffer(mapped, dtype=np.uint8)  # what arrays and tensors view

    def left(self) -> int:
        return len(self.data) - self.at

    def corrupt(self, problem: str) -> CheckpointError:
        return CheckpointError(self.path, f"truncated or corrupt GGUF file: {problem}")

    def need(self, size: int, what: str) -> None:
        if size > self.left():
            raise self.corrupt(f"{what} needs {size} bytes at offset {self.at}, where the file holds "
                               f"{self.left()} more")

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
        except UnicodeDecodeError as exc:  # (GGUF's strings are UTF-8, as gguf-py and llama.cpp read them)
            raise self.corrupt(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings (their lengths' 8 bytes each already checked to be there): the header's
        hot loop (~100k items in a real vocabulary), so inlined."""
        data, at, end, out = self.data, self.at, len(self.data), []
        length_of, append = struct.Struct(self.order + "Q").unpack_from, out.append
        index = 0
        try:
            for index in range(count):
                if at + _STRING_BYTES > end:
                    self.at = at
                    self.need(_STRING_BYTES, f"the length of item {index} of {what}")
                (length,) = length_of(data, at)
                at += _STRING_BYTES
                if length > end - at:
                    self.at = at
                    self.need(length, f"item {index} of {what}")
                append(data[at:at + length].decode("utf-8"))
                at += length
        except UnicodeDecodeError as exc:
            raise self.corrupt(f"item {index} of {what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
        self.at = at
        return out

    def view(self, dtype: np.dtype, count: int) -> np.ndarray:
        """The next `count` items of `dtype` (checked to be there), viewed in the file's byte order."""
        size = count * dtype.itemsize
        array = self.bytes[self.at:self.at + size].view(dtype.newbyteorder(self.order))
        self.at += size
        return array

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar("I", f"the value type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.corrupt(f"{what}: value type {raw}, which GGUF does not define "
                               f"(0 to {max(GGUFValueType)})") from None


def _read(header: _Header) -> GGUFFile:
    header.at = 4  # (the magic, checked)
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
    if kv_count > MAX_METADATA_OBJECTS:
        raise CheckpointError(header.path, f"it declares {kv_count} metadata keys, past the {MAX_METADATA_OBJECTS} "
                                           "keys and strings this loader reads (real headers hold under 1M)")
    if tensor_count > MAX_TENSORS:
        raise CheckpointError(header.path, f"it declares {tensor_count} tensors, past the {MAX_TENSORS} this loader "
                                           "reads (real models hold a few thousand)")
    fields = _read_metadata(header, kv_count)
    alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    tensors, data_offset = _read_tensors(header, tensor_count, alignment)
    return GGUFFile(header.path, fields, tensors, alignment, data_offset)


def _read_metadata(header: _Header, kv_count: int) -> dict[str, MetadataValue]:
    fields, objects = {}, kv_count  # (the Python objects read: the keys, and each string as it comes)
    for index in range(kv_count):
        key = header.string(f"the name of metadata key {index}")
        if key in fields:
            raise header.corrupt(f"metadata key {key!r} appears twice")
        what = f"metadata key {key!r}"
        kind = header.value_type(what)
        if kind == GGUFValueType.ARRAY:
            item = header.value_type(f"the items of {what}")
            if item == GGUFValueType.ARRAY:  # (gguf-py would recurse; llama.cpp refuses them)
                raise header.corrupt(f"{what} is an array of arrays, which GGUF readers do not take")
            count = header.scalar("Q", f"the length of {what}")
            least = count * (_STRING_BYTES if item == GGUFValueType.STRING else _NUMPY[item].itemsize)
            header.need(least, f"{what}, {count} {item.name} items,")
            if item == GGUFValueType.STRING:
                objects = _within_budget(header, objects + count, f"{what} holds {count} strings")
                fields[key] = header.strings(count, what)
            else:
                fields[key] = header.view(_NUMPY[item], count)
        elif kind == GGUFValueType.STRING:
            objects = _within_budget(header, objects + 1, f"{what} holds a string")
            fields[key] = header.string(what)
        else:
            fields[key] = header.scalar(_SCALARS[kind], what)
        if key == "general.alignment":
            _check_alignment(header, kind, fields[key])
    return fields


def _within_budget(header: _Header, objects: int, what: str) -> int:
    """`objects`, the keys and strings read so far with those `what` adds, unless past the budget."""
    if objects > MAX_METADATA_OBJECTS:
        raise CheckpointError(header.path, f"{what}, taking the metadata past the {MAX_METADATA_OBJECTS} keys and "
                                           "strings this loader reads (real vocabularies and merges come to under 1M)")
    return objects


def _check_alignment(header: _Header, kind: GGUFValueType, alignment: MetadataValue) -> None:
    if kind != GGUFValueType.UINT32:
        raise header.corrupt(f"general.alignment is a {kind.name}, expected a UINT32 (as gguf-py reads it)")
    if alignment < 1 or alignment & (alignment - 1):
        raise header.corrupt(f"general.alignment is {alignment}: expected a power of two")


def _read_tensors(header: _Header, tensor_count: int, alignment: int) -> tuple[tuple[TensorInfo, ...], int]:
    """The tensor infos, each tensor aligned and inside the data section; and where that starts."""
    infos = {}  # name -> (type, dims, offset in the data section, bytes)
    for index in range(tensor_count):
        name = header.string(f"the name of tensor {index}")
        if name in infos:
            raise header.corrupt(f"tensor {name!r} appears twice")
        n_dims = header.scalar("I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise header.corrupt(f"tensor {name!r} has {n_dims} dimensions (expected 1 to {MAX_DIMS})")
        dims = tuple(header.scalar("Q", f"the dimensions of tensor {name!r}") for _ in range(n_dims))
        if min(dims) < 1:
            raise header.corrupt(f"tensor {name!r} has dimensions {list(dims)}: expected each at least 1")
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
        # (Python's ints: dimensions that would wrap gguf-py's uint64 product are caught below)
        infos[name] = (ggml_type, dims, offset, math.prod(dims) // block * block_bytes)
    data_start = -(-header.at // alignment) * alignment
    data_bytes = max(0, len(header.data) - data_start)
    tensors = []
    for name, (ggml_type, dims, offset, n_bytes) in infos.items():
        if offset % alignment:
            raise header.corrupt(f"tensor {name!r} starts at offset {offset} of the data section, not a multiple "
                                 f"of the alignment {alignment}")
        if offset + n_bytes > data_bytes:
            raise header.corrupt(f"tensor {name!r} ({ggml_type.name}, dimensions {list(dims)}) needs {n_bytes} bytes "
                                 f"at offset {offset} of the data section, which holds {data_bytes}")
        tensors.append(_tensor(header, name, ggml_type, dims, data_start + offset, n_bytes))
    return tuple(tensors), data_start


def _tensor(header: _Header, name: str, ggml_type: GGMLQuantizationType, dims: tuple[int, ...], start: int,
            n_bytes: int) -> TensorInfo:
    """`name`'s info, its data viewed as gguf-py views it."""
    rows = tuple(reversed(dims[1:]))  # (numpy's order: the outermost first)
    raw = header.bytes[start:start + n_bytes]
    if ggml_type in _NUMERIC_TENSORS:
        data = raw.view(np.dtype(_NUMERIC_TENSORS[ggml_type]).newbyteorder(header.order)).reshape(*rows, dims[0])
    else:
        block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        data = raw.reshape(*rows, dims[0] // block * block_bytes)
    return TensorInfo(name, ggml_type, dims, math.prod(dims), n_bytes, start, data)
