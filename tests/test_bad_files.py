"""Every way a checkpoint can be unusable raises CheckpointError naming the file and problem."""

import json
import re
import resource
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from nanoinfer import CheckpointError
from nanoinfer.loaders import load_model


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path_factory.mktemp("good")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    load_model(path, device="cpu", progress=False)  # the untouched copy loads
    return path


@pytest.fixture
def broken(good_dir, tmp_path):
    """A fresh copy of the good checkpoint for one test to damage."""
    path = tmp_path / "model"
    shutil.copytree(good_dir, path)
    return path


def load_fails(path, *words):
    with pytest.raises(CheckpointError) as info:
        load_model(path, device="cpu", progress=False)
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


def test_missing_path():
    load_fails("/nonexistent/model-dir", "/nonexistent/model-dir", "not found")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    load_fails(broken, "config.json", "missing")


def test_config_not_json(broken):
    (broken / "config.json").write_text("{not json")
    load_fails(broken, "config.json", "JSON")


def test_unknown_architecture(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (broken / "config.json").write_text(json.dumps(cfg))
    load_fails(broken, "GPTNeoXForCausalLM", "not supported")


def test_missing_weights(broken):
    (broken / "model.safetensors").unlink()
    load_fails(broken, "model.safetensors")


def test_truncated_safetensors(broken):
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    load_fails(broken, "model.safetensors", "truncated or corrupt")


def test_corrupt_safetensors_header(broken):
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:8] + b"\xff" * 32 + data[40:])
    load_fails(broken, "model.safetensors", "corrupt")


def test_missing_tensor(broken):
    from safetensors.torch import load_file, save_file

    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    load_fails(broken, "model.layers.0.mlp.up_proj.weight", "missing")


def test_wrong_tensor_shape(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["intermediate_size"] = 50
    (broken / "config.json").write_text(json.dumps(cfg))
    load_fails(broken, "shape", "(50, 32)")


def test_index_names_missing_shard(broken):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    load_fails(broken, "model-00001-of-00002.safetensors", "missing")


def test_truncated_gguf(smollm2_gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src:
        path.write_bytes(src.read(3_000_000))
    load_fails(path, "cut.gguf", "truncated or corrupt")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(b"GGUX" + bytes(range(256)) * 16)
    load_fails(path, "noise.gguf", "GGUF")


def write_gguf(path, arch, tensor_type=None):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, "gpt2")
    load_fails(path, "gpt2.gguf", "'gpt2'", "not supported")


def test_gguf_missing_metadata(tmp_path):
    path = tmp_path / "bare.gguf"
    write_gguf(path, "llama")
    load_fails(path, "bare.gguf", "llama.", "missing")


# -- config.json of the wrong shape or values: one line naming the file and the field ------

def write_config(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **fields}))


@pytest.mark.parametrize("text, kind", [("[1, 2, 3]", "a list"), ("5", "a number"), ('"llama"', "a string"),
                                        ("null", "null")])
def test_config_not_an_object(broken, text, kind):
    (broken / "config.json").write_text(text)
    load_fails(broken, "config.json", f"holds {kind}", "expected a JSON object")


@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("hidden_size", -32), ("vocab_size", 1.5),
                                          ("num_hidden_layers", True), ("intermediate_size", "48"),
                                          ("num_key_value_heads", 0), ("head_dim", 0),
                                          ("max_position_embeddings", 0), ("hidden_size", [32])])
def test_config_dimension_not_a_positive_integer(broken, field, value):
    write_config(broken, **{field: value})
    load_fails(broken, "config.json", field, repr(value), "positive integer")


def test_config_dimension_past_floats(broken):
    (broken / "config.json").write_text((broken / "config.json").read_text().replace('"hidden_size": 32',
                                                                                    '"hidden_size": 1e400'))
    load_fails(broken, "config.json", "hidden_size", "inf", "positive integer")


def test_config_heads_that_do_not_divide(broken):
    write_config(broken, num_key_value_heads=3)
    load_fails(broken, "config.json", "num_attention_heads 4", "num_key_value_heads 3")


def test_config_width_not_a_multiple_of_the_heads(broken):
    write_config(broken, num_attention_heads=5, num_key_value_heads=5, head_dim=None)
    load_fails(broken, "config.json", "hidden_size 32", "num_attention_heads 5")


@pytest.mark.parametrize("field, value", [("rms_norm_eps", 0), ("rms_norm_eps", -1e-5), ("rms_norm_eps", "small"),
                                          ("rope_theta", 0), ("rope_theta", [10000])])
def test_config_numbers_not_positive(broken, field, value):
    write_config(broken, **{field: value})
    load_fails(broken, "config.json", field, repr(value), "positive")


@pytest.mark.parametrize("fields, words", [({"rope_parameters": [1, 2]}, ["rope_parameters", "[1, 2]"]),
                                           ({"rope_parameters": None, "rope_scaling": [1, 2]},
                                            ["rope_scaling", "[1, 2]"]),
                                           ({"rope_parameters": {"rope_type": "linear", "factor": 0}},
                                            ["rope_parameters", "factor", "0"]),
                                           ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                                                 "low_freq_factor": 4.0}},
                                            ["rope_parameters", "high_freq_factor"]),
                                           ({"architectures": 5}, ["architectures", "5"]),
                                           ({"bos_token_id": "<s>"}, ["bos_token_id", "'<s>'"]),
                                           ({"eos_token_id": {"a": 1}}, ["eos_token_id"])])
def test_config_fields_of_the_wrong_kind(broken, fields, words):
    write_config(broken, **fields)
    load_fails(broken, "config.json", *words)


def test_nanochat_meta_with_odd_heads(tmp_path):
    from nanoinfer.loaders.nanochat_checkpoint import nanochat_config

    meta = tmp_path / "meta_000001.json"
    meta.write_text(json.dumps({"model_config": {"sequence_len": 64, "vocab_size": 32, "n_layer": 1, "n_head": 4,
                                                 "n_kv_head": 4, "n_embd": 12}}))
    with pytest.raises(CheckpointError, match=r"meta_000001.json: .*head_dim=3"):
        nanochat_config(meta)


def test_nanochat_meta_nesting_too_deeply(tmp_path):
    from nanoinfer.loaders.nanochat_checkpoint import nanochat_config

    meta = tmp_path / "meta_000001.json"
    meta.write_text('{"model_config": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError) as info:
        nanochat_config(meta)
    assert "meta_000001.json" in str(info.value) and "nests too deeply" in str(info.value), info.value


# -- JSON a hostile file can hold: one line naming the file, never a traceback ---------------

def test_config_nesting_too_deeply(broken):
    """200 KB of brackets: past the parser's recursion limit (a RecursionError, not a JSONDecodeError)."""
    (broken / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    message = load_fails(broken, "config.json", "nests too deeply")
    assert "\n" not in message


def test_config_number_of_too_many_digits(broken):
    """Python parses at most 4300 digits into an int (a ValueError, not a JSONDecodeError)."""
    (broken / "config.json").write_text((broken / "config.json").read_text().replace('"hidden_size": 32',
                                                                                    '"hidden_size": ' + "9" * 5000))
    message = load_fails(broken, "config.json", "not valid JSON", "digits")
    assert "\n" not in message


# -- hostile safetensors files and indexes -------------------------------------------------

def safetensors_bytes(header, data=b"", length=None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


EMBED = "model.embed_tokens.weight"
HOSTILE_SAFETENSORS = {
    "header_length_2^60": safetensors_bytes(b"{}", length=1 << 60),
    "header_past_the_end": safetensors_bytes(b'{"a": 1}', length=1000),
    "header_not_json": safetensors_bytes(b"{not json"),
    "header_a_list": safetensors_bytes(b"[1, 2]"),
    "data_past_the_end": safetensors_bytes({EMBED: {"dtype": "F32", "shape": [64, 32], "data_offsets": [0, 8192]}},
                                           b"\0" * 64),
    "offsets_not_the_shape": safetensors_bytes({EMBED: {"dtype": "F32", "shape": [64, 32], "data_offsets": [0, 64]}},
                                               b"\0" * 64),
    "shape_overflows": safetensors_bytes({EMBED: {"dtype": "F32", "shape": [1 << 62, 1 << 62],
                                                  "data_offsets": [0, 64]}}, b"\0" * 64),
    "overlapping": safetensors_bytes({EMBED: {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
                                      "lm_head.weight": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}},
                                     b"\0" * 64),
    "negative_offset": safetensors_bytes({EMBED: {"dtype": "F32", "shape": [16], "data_offsets": [-64, 0]}},
                                         b"\0" * 64),
}


@pytest.mark.parametrize("name", HOSTILE_SAFETENSORS)
def test_hostile_safetensors(broken, name):
    (broken / "model.safetensors").write_bytes(HOSTILE_SAFETENSORS[name])
    load_fails(broken, "model.safetensors", "corrupt")


def test_safetensors_weight_not_a_float(broken):
    from safetensors.torch import load_file, save_file

    tensors = load_file(broken / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    load_fails(broken, "model.safetensors", "model.norm.weight", "int32")


@pytest.mark.parametrize("index, words", [
    ([1, 2], ["holds a list"]),
    ({"weight_map": [EMBED]}, ["weight_map", "list"]),
    ({"weight_map": {EMBED: 5}}, [EMBED, "5"]),
    ({"weight_map": {EMBED: "../model/model.safetensors"}}, [EMBED, "../model/model.safetensors"]),
    ({"weight_map": {EMBED: "/etc/passwd"}}, [EMBED, "/etc/passwd"]),
])
def test_index_of_the_wrong_shape(broken, index, words):
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    load_fails(broken, "model.safetensors.index.json", *words)


def test_index_not_text(broken):
    (broken / "model.safetensors.index.json").write_bytes(b"\xff\xfe{")
    load_fails(broken, "model.safetensors.index.json")


# -- GGUF metadata values: the same one line, naming the key -------------------------------

def write_llama_gguf(path, **overrides):
    """A GGUF with every key gguf_config reads (no tensors: the check comes first), `overrides`
    written in their place (key without the "llama." prefix -> value, typed as given)."""
    values = {"block_count": 1, "attention.head_count": 4, "attention.head_count_kv": 2, "embedding_length": 32,
              "feed_forward_length": 48, "context_length": 64, "vocab_size": 64, **overrides}
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in values.items():
        name = key if key.startswith("tokenizer.") else f"llama.{key}"
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        elif value >= 1 << 31:
            writer.add_uint64(name, value)
        else:
            writer.add_int32(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("overrides, words", [
    ({"attention.head_count": 0}, ["llama.attention.head_count", "0", "positive integer"]),
    ({"block_count": "one"}, ["llama.block_count", "'one'"]),
    ({"embedding_length": 32.5}, ["llama.embedding_length", "32.5"]),
    ({"feed_forward_length": -48}, ["llama.feed_forward_length", "-48"]),
    ({"context_length": 0}, ["llama.context_length", "0"]),
    ({"attention.head_count_kv": 3}, ["llama.attention.head_count 4", "llama.attention.head_count_kv 3"]),
    ({"attention.head_count": 5, "attention.head_count_kv": 5}, ["llama.embedding_length 32",
                                                                 "llama.attention.head_count 5"]),
    ({"attention.layer_norm_rms_epsilon": -1.0}, ["llama.attention.layer_norm_rms_epsilon", "-1.0"]),
    ({"rope.freq_base": "big"}, ["llama.rope.freq_base", "'big'"]),
    ({"tokenizer.ggml.bos_token_id": "x"}, ["tokenizer.ggml.bos_token_id", "'x'"]),
    ({"tokenizer.ggml.eos_token_id": "x"}, ["tokenizer.ggml.eos_token_id", "'x'"]),
])
def test_gguf_metadata_values(tmp_path, overrides, words):
    path = tmp_path / "values.gguf"
    write_llama_gguf(path, **overrides)
    load_fails(path, "values.gguf", *words)


# -- dimensions past any real model's: refused where the loader first reads them, naming the key --

@pytest.fixture
def memory_capped():
    """Address space capped at 1 GiB past what the process maps: a regression that sizes a
    list by a hostile count fails with a MemoryError here instead of eating the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(re.search(r"VmSize:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_config_of_ten_billion_layers(tmp_path, memory_capped):
    """The review's 200-byte config.json: Qwen2's per-layer window list would hold 10^10 entries."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 48,
        "vocab_size": 64, "num_hidden_layers": 10**10, "use_sliding_window": True, "sliding_window": 4096}))
    message = load_fails(tmp_path, "config.json", "num_hidden_layers", "10000000000", "at most 4096")
    assert "\n" not in message


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 4097), ("num_attention_heads", 1 << 17),
                                          ("num_key_value_heads", 1 << 17), ("hidden_size", 1 << 21),
                                          ("intermediate_size", 1 << 23), ("head_dim", 1 << 17),
                                          ("vocab_size", 1 << 25)])
def test_config_dimension_past_any_model(broken, field, value, memory_capped):
    write_config(broken, **{field: value})
    load_fails(broken, "config.json", field, str(value), "at most")


@pytest.mark.parametrize("key, value", [("block_count", 10**10), ("attention.head_count", 1 << 17),
                                        ("attention.head_count_kv", 1 << 17), ("embedding_length", 1 << 21),
                                        ("feed_forward_length", 1 << 23), ("attention.key_length", 1 << 17),
                                        ("vocab_size", 1 << 25)])
def test_gguf_dimension_past_any_model(tmp_path, key, value, memory_capped):
    path = tmp_path / "huge.gguf"
    write_llama_gguf(path, **{key: value})
    load_fails(path, "huge.gguf", f"llama.{key}", str(value), "at most")


def test_nanochat_meta_of_ten_billion_layers(tmp_path, memory_capped):
    from nanoinfer.loaders.nanochat_checkpoint import nanochat_config

    meta = tmp_path / "meta_000001.json"
    meta.write_text(json.dumps({"model_config": {"sequence_len": 64, "vocab_size": 32, "n_layer": 10**10,
                                                 "n_head": 4, "n_kv_head": 4, "n_embd": 32}}))
    with pytest.raises(CheckpointError, match=r"meta_000001.json: .*n_layer is 10000000000.*at most 4096"):
        nanochat_config(meta)


def test_llama2c_header_of_two_billion_layers(tmp_path, memory_capped):
    path = tmp_path / "model.bin"
    path.write_bytes(struct.pack("<7i", 32, 48, 2**31 - 1, 4, 2, 64, 64) + b"\0" * 64)
    load_fails(path, "model.bin", "n_layers", str(2**31 - 1), "at most 4096")


# -- a hostile value is named, not copied: error lines stay short ----------------------------

HUGE = "x" * 1_000_000


@pytest.mark.parametrize("fields, word", [({"hidden_size": HUGE}, "hidden_size"),
                                          ({"architectures": [HUGE]}, "architecture"),
                                          ({"architectures": HUGE}, "architectures"),
                                          ({"rope_parameters": {"rope_type": "linear", "factor": HUGE}}, "factor"),
                                          ({"rope_parameters": {"rope_type": HUGE}}, "rope scaling type"),
                                          ({"rope_parameters": None, "rope_scaling": [HUGE]}, "rope_scaling"),
                                          ({"rms_norm_eps": HUGE}, "rms_norm_eps"),
                                          ({"bos_token_id": HUGE}, "bos_token_id")])
def test_config_error_lines_stay_short(broken, fields, word):
    write_config(broken, **fields)
    message = load_fails(broken, "config.json", word, "xxx")
    assert len(message) < 400 + len(str(broken)) and "\n" not in message, message[:1000]


@pytest.mark.parametrize("key", ["block_count", "rope.scaling.type"])
def test_gguf_error_lines_stay_short(tmp_path, key):
    path = tmp_path / "long.gguf"
    write_llama_gguf(path, **{key: HUGE})
    message = load_fails(path, "long.gguf", f"llama.{key}" if key == "block_count" else "rope scaling type", "xxx")
    assert len(message) < 400 + len(str(path)) and "\n" not in message, message[:1000]


def test_index_error_lines_stay_short(broken):
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {HUGE: "/" + HUGE}}))
    message = load_fails(broken, "model.safetensors.index.json", "weight_map", "xxx")
    assert len(message) < 400 + len(str(broken)) and "\n" not in message, message[:1000]
