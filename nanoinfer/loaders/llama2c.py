"""llama2.c checkpoints: Karpathy's `.bin` export (fp32 weights behind a small header), with
its `tokenizer.bin` beside it, loaded through the Llama path.

Two layouts, as llama2.c's export.py writes them:
- version 0 ("legacy"): 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
  seq_len; a negative vocab_size means the classifier is not the embedding), then every
  tensor in fp32: embedding, attention norms, wq, wk, wv, wo, FFN norms, w1, w2, w3, final
  norm, the precomputed RoPE tables (skipped), and the classifier when it is its own.
- version 1: magic "ak42" (uint32 0x616b3432), int32 version 1, the same 7 ints, a uint8
  "shared classifier" flag, zero-padded to 256 bytes; then the norms of every layer, the
  final norm, the embedding, wq, wk, wv, wo, w1, w2, w3 (each for every layer) and the
  classifier unless shared.
(Version 2, Q8_0 int8, is refused by name.) Matrices are [out, in] rows as nn.Linear holds
them, with Meta's rotary layout for wq/wk (each head's dimension pairs adjacent): we rotate
halves as Hugging Face does, so their rows are regrouped once at load.

The tokenizer.bin is read by nanoinfer/text/tokenizer.py (`Tokenizer.from_llama2c`).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from nanoinfer.model.config import ModelConfig, checkpoint_config
from nanoinfer.model.config_checks import MAX_DIMENSIONS, dimension
from nanoinfer.errors import CheckpointError
from nanoinfer.loaders.params import build_params, unpermute_rotary_rows
from nanoinfer.model.decoder import Params

MAGIC = 0x616B3432  # "ak42", little-endian, version 1 and later
V1_HEADER = 256
# The header's 7 ints (llama2.c's Config) -> ModelConfig's fields (whose MAX_DIMENSIONS bound them)
HEADER_FIELDS = {"dim": "hidden_size", "hidden_dim": "intermediate_size", "n_layers": "num_layers",
                 "n_heads": "num_heads", "n_kv_heads": "num_kv_heads", "vocab_size": "vocab_size",
                 "seq_len": "max_position_embeddings"}


def llama2c_config(path: Path) -> tuple[ModelConfig, int, bool]:
    """(config, byte offset of the first tensor, whether the classifier is the embedding)."""
    with open(path, "rb") as f:
        head = f.read(V1_HEADER)
    if len(head) < 28:
        raise CheckpointError(path, f"{len(head)} bytes: too short for a llama2.c checkpoint's header")
    magic, version = struct.unpack_from("<Ii", head)
    if magic == MAGIC:
        if version != 1:
            raise CheckpointError(path, f"llama2.c export version {version} is not supported (expected 0, the "
                                        "legacy fp32 layout, or 1; version 2 is int8 Q8_0)")
        if len(head) < V1_HEADER:
            raise CheckpointError(path, f"{len(head)} bytes: too short for a version-1 llama2.c header")
        dims, shared, offset = struct.unpack_from("<7i", head, 8), bool(head[36]), V1_HEADER
    else:
        dims, offset = struct.unpack_from("<7i", head), 28
        shared = dims[5] > 0
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = dims
    vocab = abs(vocab)
    for (name, field), value in zip(HEADER_FIELDS.items(), (dim, hidden, layers, heads, kv_heads, vocab, seq_len)):
        dimension(name, value, path, MAX_DIMENSIONS.get(field))
    if dim % heads or heads % kv_heads or (dim // heads) % 2:
        raise CheckpointError(path, f"header (dim={dim}, n_heads={heads}, n_kv_heads={kv_heads}) does not describe "
                                    "a Llama model: expected dim divisible by n_heads into an even head size, "
                                    "n_heads by n_kv_heads")
    cfg = checkpoint_config(path, architecture="llama", vocab_size=vocab, hidden_size=dim, intermediate_size=hidden,
                            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim // heads,
                            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=seq_len,
                            tie_word_embeddings=shared, bos_token_id=1, eos_token_ids=(2,), torch_dtype="float32")
    return cfg, offset, shared


def _layout(cfg: ModelConfig, legacy: bool, shared: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The file's tensors in order: (name, shape), names ours for the whole stack."""
    L, d, h, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.q_size, cfg.kv_size
    matrices = [("wq", (L, q, d)), ("wk", (L, kv, d)), ("wv", (L, kv, d)), ("wo", (L, d, q))]
    ffn = [("w1", (L, h, d)), ("w2", (L, d, h)), ("w3", (L, h, d))]
    if legacy:
        rope = cfg.max_position_embeddings * cfg.head_dim // 2
        order = ([("embed", (v, d)), ("attn_norm", (L, d))] + matrices + [("ffn_norm", (L, d))] + ffn
                 + [("final_norm", (d,)), ("rope_real", (rope,)), ("rope_imag", (rope,))])
    else:
        order = [("attn_norm", (L, d)), ("ffn_norm", (L, d)), ("final_norm", (d,)), ("embed", (v, d))] + matrices + ffn
    return order + ([] if shared else [("classifier", (v, d))])


def load_llama2c_params(path: Path, cfg: ModelConfig, offset: int, shared: bool, dtype: torch.dtype, device,
                        progress: bool = True) -> Params:
    layout = _layout(cfg, offset != V1_HEADER, shared)
    expected = offset + 4 * sum(int(np.prod(shape)) for _, shape in layout)
    size = path.stat().st_size
    if size != expected:
        raise CheckpointError(path, f"{size} bytes where its header describes {expected} (truncated, or not a "
                                    "llama2.c fp32 export)")
    data = np.memmap(path, dtype="<f4", mode="r", offset=offset)
    tensors, at = {}, 0
    for name, shape in layout:
        n = int(np.prod(shape))
        tensors[name] = torch.from_numpy(np.array(data[at:at + n])).reshape(shape)
        at += n
    hf = {"model.embed_tokens.weight": tensors["embed"], "model.norm.weight": tensors["final_norm"],
          "lm_head.weight": tensors.get("classifier")}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        hf |= {p + "input_layernorm.weight": tensors["attn_norm"][i],
               p + "post_attention_layernorm.weight": tensors["ffn_norm"][i],
               # (Meta's rotary pairs -> HF's halves, per head)
               p + "self_attn.q_proj.weight": unpermute_rotary_rows(tensors["wq"][i], cfg.num_heads),
               p + "self_attn.k_proj.weight": unpermute_rotary_rows(tensors["wk"][i], cfg.num_kv_heads),
               p + "self_attn.v_proj.weight": tensors["wv"][i], p + "self_attn.o_proj.weight": tensors["wo"][i],
               p + "mlp.gate_proj.weight": tensors["w1"][i], p + "mlp.down_proj.weight": tensors["w2"][i],
               p + "mlp.up_proj.weight": tensors["w3"][i]}
    return build_params(hf.get, cfg, dtype, device, path, progress=progress)
