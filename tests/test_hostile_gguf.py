"""A GGUF header is checked against the file's size as it is read: every hostile count, length,
type or offset is a CheckpointError naming the file and the field, raised before anything it
describes is allocated or iterated; gguf-py's GGUFReader (which trusts them: it loops once per
declared item) is never built."""

import resource
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest

from nanoinfer import CheckpointError
from nanoinfer.loaders import gguf as gguf_loader
from nanoinfer import gguf_file as gguf_file_module
from nanoinfer.gguf_file import MAX_METADATA_OBJECTS, MAX_TENSORS, read_gguf

V = gguf.GGUFValueType
F32, Q4_0 = int(gguf.GGMLQuantizationType.F32), int(gguf.GGMLQuantizationType.Q4_0)


# -- a GGUF written by hand, field by field, so that any field can lie ----------------------

def string(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def kv(key: str | bytes, value_type: int, payload: bytes) -> bytes:
    return string(key) + struct.pack("<I", value_type) + payload


def array(item_type: int, count: int, items: bytes) -> bytes:
    return struct.pack("<IQ", item_type, count) + items


def tensor_info(name: str | bytes, dims, ggml_type: int = F32, offset: int = 0, n_dims: int | None = None) -> bytes:
    return (string(name) + struct.pack("<I", len(dims) if n_dims is None else n_dims)
            + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ggml_type, offset))


def gguf_file(kvs=(), tensors=(), data: bytes = b"", *, magic=b"GGUF", version=3, n_kv=None, n_tensors=None) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % 32 if data else 0) + data


ARCH = kv("general.architecture", V.STRING, string("llama"))
ONE_TENSOR = tensor_info("w", [8])  # 8 F32: 32 bytes
DATA = b"\0" * 32


class ReaderBuilt(BaseException):
    """Raised past any `except Exception` on the load path."""


@pytest.fixture
def no_reader(monkeypatch):
    """gguf-py's reader fails the test if it is built: the load path reads headers itself."""

    def reader(self, path, *args, **kwargs):
        raise ReaderBuilt(f"gguf-py's GGUFReader was built on {path}")

    monkeypatch.setattr(gguf.GGUFReader, "__init__", reader)


def refused(path, *words) -> str:
    with pytest.raises(CheckpointError) as info:
        gguf_loader.open_gguf(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


def test_the_hand_written_file_is_a_gguf(tmp_path):
    """The writer above makes files gguf-py reads, so each hostile variant below fails for its lie."""
    path = tmp_path / "good.gguf"
    path.write_bytes(gguf_file([ARCH, kv("general.tokens", V.ARRAY, array(V.STRING, 2, string("a") + string("bc")))],
                               [ONE_TENSOR, tensor_info("v", [8], offset=32)], DATA * 2))
    assert gguf.GGUFReader(path).fields["general.tokens"].contents() == ["a", "bc"]
    header = gguf_loader.open_gguf(path)
    assert header.fields["general.tokens"] == ["a", "bc"]
    assert [t.name for t in header.tensors] == ["w", "v"]


HOSTILE = {
    # issue 59's 73 bytes: 2^60 UINT32 items declared, 16 bytes of them
    "array_past_end": (gguf_file([kv("general.x", V.ARRAY, array(V.UINT32, 1 << 60, b"\0" * 16))]),
                       ["general.x", str(1 << 60), "16"]),
    "key_length": (gguf_file([struct.pack("<Q", 1 << 62) + b"general.x" + struct.pack("<IB", V.UINT8, 0)]),
                   ["metadata key 0", str(1 << 62)]),
    "string_length": (gguf_file([kv("general.name", V.STRING, string("x", 1 << 40))]), ["general.name", str(1 << 40)]),
    "string_in_array": (gguf_file([kv("tokenizer.ggml.tokens", V.ARRAY,
                                      array(V.STRING, 2, string("a") + string("b", 1 << 50)))]),
                        ["tokenizer.ggml.tokens", "item 1", str(1 << 50)]),
    "strings_past_end": (gguf_file([kv("tokenizer.ggml.tokens", V.ARRAY, array(V.STRING, 1 << 40, string("a")))]),
                         ["tokenizer.ggml.tokens", str(1 << 40)]),
    "kv_count": (gguf_file([ARCH], n_kv=1 << 40), ["metadata keys", str(1 << 40)]),
    "tensor_count": (gguf_file([ARCH], [ONE_TENSOR], DATA, n_tensors=1 << 40), ["tensors", str(1 << 40)]),
    "value_type": (gguf_file([kv("general.x", 13, b"\0" * 8)]), ["general.x", "13"]),
    "item_type": (gguf_file([kv("general.x", V.ARRAY, array(13, 1, b"\0" * 8))]), ["general.x", "13"]),
    "array_of_arrays": (gguf_file([kv("general.x", V.ARRAY, array(V.ARRAY, 1, array(V.UINT8, 1, b"\0")))]),
                        ["general.x", "arrays"]),
    "duplicate_key": (gguf_file([ARCH, ARCH]), ["general.architecture", "twice"]),
    "key_not_utf8": (gguf_file([kv(b"general.\xff", V.UINT8, b"\0")]), ["metadata key 0", "UTF-8"]),
    "string_not_utf8": (gguf_file([kv("general.name", V.STRING, string(b"\xff\xfe"))]), ["general.name", "UTF-8"]),
    "alignment_zero": (gguf_file([kv("general.alignment", V.UINT32, struct.pack("<I", 0))]),
                       ["general.alignment", "0", "power of two"]),
    "alignment_48": (gguf_file([kv("general.alignment", V.UINT32, struct.pack("<I", 48))]),
                     ["general.alignment", "48", "power of two"]),
    "alignment_type": (gguf_file([kv("general.alignment", V.UINT64, struct.pack("<Q", 32))]),
                       ["general.alignment", "UINT64"]),
    "n_dims": (gguf_file([ARCH], [tensor_info("w", [8], n_dims=(1 << 32) - 1)], DATA), ["'w'", str((1 << 32) - 1)]),
    "no_dims": (gguf_file([ARCH], [tensor_info("w", [], n_dims=0)], DATA), ["'w'", "0 dimensions"]),
    "zero_dim": (gguf_file([ARCH], [tensor_info("w", [8, 0])], DATA), ["'w'", "[8, 0]"]),
    "dims_overflow": (gguf_file([ARCH], [tensor_info("w", [1 << 32, 1 << 32, 1 << 32])], DATA), ["'w'", "bytes"]),
    "dims_past_file": (gguf_file([ARCH], [tensor_info("w", [1000, 1000])], DATA), ["'w'", "4000000", "32"]),
    "offset_past_end": (gguf_file([ARCH], [tensor_info("w", [8], offset=1 << 40)], DATA), ["'w'", str(1 << 40)]),
    "misaligned": (gguf_file([ARCH], [tensor_info("w", [8], offset=4)], DATA * 2), ["'w'", "offset 4", "32"]),
    "ggml_type": (gguf_file([ARCH], [tensor_info("w", [8], ggml_type=99)], DATA), ["'w'", "99"]),
    "block_size": (gguf_file([ARCH], [tensor_info("w", [16], ggml_type=Q4_0)], DATA), ["'w'", "Q4_0", "32"]),
    "duplicate_tensor": (gguf_file([ARCH], [ONE_TENSOR, ONE_TENSOR], DATA), ["'w'", "twice"]),
    "tensor_name_not_utf8": (gguf_file([ARCH], [tensor_info(b"w\xff", [8])], DATA), ["tensor 0", "UTF-8"]),
    "magic": (gguf_file([ARCH], magic=b"GGUX"), ["GGUX", "GGUF"]),
    "version_1": (gguf_file([ARCH], version=1), ["version 1"]),
    "version_4": (gguf_file([ARCH], version=4), ["version 4"]),
    "short": (b"GGUF\x03\x00", ["truncated"]),
    "empty": (b"", ["GGUF"]),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_header_is_refused_before_the_reader_runs(name, tmp_path, no_reader):
    data, words = HOSTILE[name]
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data)
    refused(path, *words)


def test_more_strings_than_the_budget(tmp_path, no_reader):
    """A header that does hold its strings is still refused past the budget, before any is read:
    each is a Python object (and a vocabulary entry to its tokenizer)."""
    count = MAX_METADATA_OBJECTS  # with the one key, one past
    path = tmp_path / "strings.gguf"
    path.write_bytes(gguf_file([kv("general.x", V.ARRAY, array(V.STRING, count, string("") * count))]))
    refused(path, "general.x", str(count), str(MAX_METADATA_OBJECTS))


def test_more_keys_than_the_budget(tmp_path, no_reader):
    """Each key is a Python object too: a header that does hold its keys (13 bytes each) is
    refused past the budget before the first is read."""
    count = MAX_METADATA_OBJECTS + 1
    path = tmp_path / "keys.gguf"
    path.write_bytes(gguf_file([kv("", V.UINT8, b"\0")] * count))
    refused(path, "metadata keys", str(count), str(MAX_METADATA_OBJECTS))


def test_keys_and_their_string_values_count_against_the_budget(tmp_path, no_reader, monkeypatch):
    """The review's million distinct keys (26 MB) loaded whole, +151 MB with the budget at 1000:
    keys and every string (a scalar's or an array's) are held to it together."""
    monkeypatch.setattr(gguf_file_module, "MAX_METADATA_OBJECTS", 1000)
    path = tmp_path / "keys.gguf"
    path.write_bytes(gguf_file([kv(f"general.k{i}", V.UINT8, b"\0") for i in range(1001)]))
    refused(path, "1001 metadata keys", "1000")
    path.write_bytes(gguf_file([kv(f"general.k{i}", V.UINT8, b"\0") for i in range(1000)]))
    assert len(read_gguf(path).fields) == 1000
    path.write_bytes(gguf_file([kv(f"general.k{i}", V.STRING, string("v")) for i in range(501)]))
    refused(path, "general.k499", "1000")  # (501 keys, then 500 strings)
    path.write_bytes(gguf_file([kv(f"general.k{i}", V.STRING, string("v")) for i in range(500)]))
    assert len(read_gguf(path).fields) == 500


def test_numeric_arrays_are_views_past_the_budget(tmp_path, no_reader):
    """A numeric array costs no Python object per item: any length the file holds is read."""
    count = MAX_METADATA_OBJECTS + 1
    path = tmp_path / "numbers.gguf"
    path.write_bytes(gguf_file([kv("general.x", V.ARRAY, array(V.UINT8, count, b"\1" * count))]))
    values = gguf_loader.open_gguf(path).fields["general.x"]
    assert values.shape == (count,) and values.base is not None and int(values.sum()) == count


def test_more_tensors_than_the_budget(tmp_path, no_reader):
    count = MAX_TENSORS + 1
    path = tmp_path / "tensors.gguf"
    path.write_bytes(gguf_file([ARCH], [ONE_TENSOR] * count, DATA))
    refused(path, str(count), str(MAX_TENSORS))


def small_gguf(path):
    """A small valid GGUF (a string array, an int array, a float, a bool; F32 and Q8_0 tensors), its
    last tensor ending the file: no padding after it, so that every shorter prefix is damaged."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b", "c"])
    writer.add_token_types([1, 1, 3])
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, 34), dtype=np.uint8),  # 2 rows of one Q8_0 block
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", np.ones((3, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_truncation_of_a_valid_file_is_refused(tmp_path):
    path = tmp_path / "small.gguf"
    small_gguf(path)
    data = path.read_bytes()
    read_gguf(path)  # the whole file passes
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="small.gguf"):
            read_gguf(path)


def test_the_default_model_loads_without_gguf_py_s_reader(smollm2_gguf, no_reader):
    from nanoinfer.loaders import load_model

    model = load_model(smollm2_gguf, device="cpu", load_format="dummy", progress=False)
    assert model.tokenizer.encode("Hello") and model.config.num_layers == 30


def test_the_cli_names_the_file_in_one_line(tmp_path):
    """Issue 59's file through `nanoinfer generate`, its address space capped at 4 GB so that a
    regression fails here instead of eating the machine."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(HOSTILE["array_past_end"][0])
    assert path.stat().st_size == 73

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--model", str(path), "--device", "cpu",
                           "hi"], capture_output=True, text=True, timeout=60, preexec_fn=cap_memory)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.gguf" in lines[0] and "general.x" in lines[0], proc.stderr
