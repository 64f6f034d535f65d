"""Every way a checkpoint can be unusable raises CheckpointError naming the file and problem."""

import json
import shutil

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
