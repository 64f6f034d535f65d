"""read_gguf gives what gguf-py's GGUFReader gives (every field's value, every tensor's name,
shape, type, bytes and data view), on the default model and on files of every value type and
both byte orders; and its memory is bounded by the header's bytes where gguf-py's was not."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from nanoinfer.gguf_file import read_gguf

ROOT = Path(__file__).resolve().parent.parent
V = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType


def assert_same_as_gguf_py(path):
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    expected = {name: f for name, f in theirs.fields.items() if not name.startswith("GGUF.")}  # (its own counts)
    assert list(ours.fields) == list(expected)
    for name, f in expected.items():
        value = ours.fields[name]
        if isinstance(value, np.ndarray):  # a view of the file in its byte order, as gguf-py's items are
            assert not f.data or value.dtype == f.parts[f.data[0]].dtype, name
            value = value.tolist()
        assert value == f.contents() and type(value) is type(f.contents()), name
    assert ours.alignment == theirs.alignment and ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for got, want in zip(ours.tensors, theirs.tensors):
        assert (got.name, got.tensor_type, got.shape, got.n_elements, got.n_bytes, got.data_offset) == \
               (want.name, want.tensor_type, tuple(want.shape.tolist()), want.n_elements, want.n_bytes,
                want.data_offset)
        assert (got.data.shape, got.data.dtype) == (want.data.shape, want.data.dtype), got.name
        assert np.array_equal(got.data, want.data), got.name
        assert not got.data.flags.writeable  # (the file is mapped read-only)
    return ours


def test_the_default_model(smollm2_gguf):
    header = assert_same_as_gguf_py(smollm2_gguf)
    assert len(header.fields["tokenizer.ggml.tokens"]) == 49152


SCALARS = {V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000, V.UINT32: 4_000_000_000,
           V.INT32: -2_000_000_000, V.UINT64: 1 << 63, V.INT64: -(1 << 62), V.FLOAT32: 1.5, V.FLOAT64: -2.25,
           V.BOOL: True, V.STRING: "héllo ✓"}
ARRAYS = {V.UINT8: [0, 255], V.INT8: [-128, 127], V.UINT16: [1, 65535], V.INT16: [-32768, 5],
          V.UINT32: [7, 1 << 31], V.INT32: [-1, 3], V.UINT64: [1 << 63, 2], V.INT64: [-(1 << 62), 4],
          V.FLOAT32: [0.5, -3.0], V.FLOAT64: [1e300, -0.0], V.BOOL: [True, False, True], V.STRING: ["a", "", "✓ü"]}


def write_every_kind(path, endianness):
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianness)
    for kind, value in SCALARS.items():
        writer.add_key_value(f"test.scalar.{kind.name}", value, kind)
    for kind, value in ARRAYS.items():
        writer.add_key_value(f"test.array.{kind.name}", value, V.ARRAY, sub_type=kind)
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16, np.float64, np.int8, np.int16, np.int32, np.int64):
        writer.add_tensor(f"t.{np.dtype(dtype).name}", (rng.standard_normal((3, 5)) * 10).astype(dtype))
    writer.add_tensor("t.4d", rng.standard_normal((2, 1, 3, 4)).astype(np.float32))
    for qtype in (QT.Q8_0, QT.Q4_K, QT.BF16):  # raw bytes, [rows, bytes per row]: 4 rows of 256 values
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor(f"t.{qtype.name}", rng.integers(0, 256, (4, 256 // block * block_bytes), dtype=np.uint8),
                          raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("endianness", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_every_value_type_and_tensor_type(endianness, tmp_path):
    path = tmp_path / "every.gguf"
    write_every_kind(path, endianness)
    header = assert_same_as_gguf_py(path)
    assert header.alignment == 64 and header.data_offset % 64 == 0
    assert header.fields["test.scalar.STRING"] == "héllo ✓"
    assert header.fields["test.array.STRING"] == ["a", "", "✓ü"]
    assert header.fields["test.array.FLOAT64"].tolist() == [1e300, -0.0]
    assert header.fields["test.scalar.BOOL"] is True
    by_name = {t.name: t for t in header.tensors}
    assert by_name["t.4d"].shape == (4, 3, 1, 2) and by_name["t.4d"].data.shape == (2, 1, 3, 4)
    assert by_name["t.Q4_K"].shape == (256, 4) and by_name["t.Q4_K"].data.shape == (4, 144)


def test_empty_arrays(tmp_path):
    """(GGUFWriter writes no empty array, llama.cpp's writer does.)"""
    def key(name, body):
        return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", V.ARRAY) + body

    path = tmp_path / "empty.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + key("a.strings", struct.pack("<IQ", V.STRING, 0))
                     + key("a.floats", struct.pack("<IQ", V.FLOAT32, 0)))
    header = assert_same_as_gguf_py(path)
    assert header.fields["a.strings"] == [] and header.fields["a.floats"].shape == (0,)


def test_an_empty_array_is_an_array_of_any_kind(tmp_path):
    """An empty array's item type tells nothing (writers pick one; gguf-py's reader gave [] for
    any): each typed read takes it, as strings, integers or numbers."""
    def key(name, item_type):
        return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<IIQ", V.ARRAY, item_type, 0)

    path = tmp_path / "empty.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 3) + key("a.strings", V.STRING) + key("a.ints", V.INT32)
                     + key("a.bools", V.BOOL))
    header = read_gguf(path)
    for name in ("a.strings", "a.ints", "a.bools"):
        assert header.strings(name) == [], name
        assert header.integers(name).shape == (0,) and header.integers(name).dtype.kind in "iu", name
        assert header.numbers(name).shape == (0,) and header.numbers(name).dtype.kind in "iuf", name


PEAK_GROWTH = """
import json, re, sys
from nanoinfer.gguf_file import read_gguf

def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

open("/proc/self/clear_refs", "w").write("5")  # (the peak, VmHWM, restarts at the current RSS)
before = status("VmRSS")
header = read_gguf(sys.argv[1])
print(json.dumps({"growth": status("VmHWM") - before, "strings": len(header.fields["tokenizer.ggml.tokens"])}))
"""


def strings_gguf(path, count, string=b""):
    item = struct.pack("<Q", len(string)) + string
    key = b"tokenizer.ggml.tokens"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", V.ARRAY, V.STRING, count) + item * count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc/self/status")
@pytest.mark.parametrize("string", [b"", "✓".encode()], ids=["empty", "one_char_of_3_bytes"])
def test_memory_is_bounded_by_the_headers_bytes(string, tmp_path):
    """A million strings (8 and 11 MB): gguf-py's reader grew by 1.6 GB (200 times the file) and took
    ~30 s on the empty ones, numpy views per item; read_gguf holds a list of str objects (measured:
    +17 MB, the empty one shared, and +105 MB for the 3-byte ones, the mapped file's pages included)."""
    path = tmp_path / "strings.gguf"
    strings_gguf(path, 1 << 20, string)
    done = subprocess.run([sys.executable, "-c", PEAK_GROWTH, str(path)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["strings"] == 1 << 20
    assert result["growth"] < 16 * path.stat().st_size, (result, path.stat().st_size)
