"""A tiny nanochat checkpoint written as nanochat writes one, and an independent reference of
its architecture (nanochat's gpt.py forward in plain torch, no cache): the oracle of
tests/test_nanochat.py and of the GPU test."""

import json
import math

import torch
import torch.nn.functional as F

# Small, but with what the architecture has: GQA (4 query heads over 1 KV head, so a token's
# normed embedding takes two extra pool layers), a padded vocabulary (300 -> 320), value
# embeddings on layers 1 and 3, "SSSL" windows of 129 keys (sequence_len 256), backout at 2.
META = {"sequence_len": 256, "vocab_size": 300, "n_layer": 4, "n_head": 4, "n_kv_head": 1, "n_embd": 64,
        "window_pattern": "SSSL"}


def nanochat_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random state dict with nanochat's names and shapes (gpt.py), scalars away from their
    neutral values so that each path counts."""
    g = torch.Generator().manual_seed(seed)
    C, L, H, Hkv = META["n_embd"], META["n_layer"], META["n_head"], META["n_kv_head"]
    D, V = C // H, math.ceil(META["vocab_size"] / 64) * 64

    def r(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    sd = {"transformer.wte.weight": r(V, C, scale=1.0), "lm_head.weight": r(V, C),
          "resid_lambdas": 1 + r(L, scale=0.1), "x0_lambdas": 0.2 + r(L, scale=0.1),
          "smear_gate.weight": r(1, 24), "smear_lambda": torch.tensor([0.6]), "backout_lambda": torch.tensor([0.3])}
    for i in range(L):
        p = f"transformer.h.{i}."
        sd |= {p + "attn.c_q.weight": r(H * D, C), p + "attn.c_k.weight": r(Hkv * D, C),
               p + "attn.c_v.weight": r(Hkv * D, C), p + "attn.c_proj.weight": r(C, C),
               p + "mlp.c_fc.weight": r(4 * C, C), p + "mlp.c_proj.weight": r(C, 4 * C, scale=0.1)}
        if i % 2 == (L - 1) % 2:
            sd |= {p + "attn.ve_gate.weight": r(Hkv, 12), f"value_embeds.{i}.weight": r(V, Hkv * D, scale=1.0)}
    return sd


def write_checkpoint(directory, sd, step: int = 650, compiled: bool = False) -> None:
    """As nanochat's save_checkpoint: model_<step>.pt (torch.save of the state dict, `_orig_mod.`
    names if saved from a compiled model) and meta_<step>.json."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({("_orig_mod." if compiled else "") + k: v for k, v in sd.items()}, directory / f"model_{step:06d}.pt")
    (directory / f"meta_{step:06d}.json").write_text(json.dumps({"step": step, "val_bpb": 1.0, "model_config": META}))


def reference_logits(sd: dict[str, torch.Tensor], idx: list[int]) -> torch.Tensor:
    """nanochat's GPT.forward (gpt.py, no KV cache), in plain torch fp32: every position's logits."""
    C, L, H, Hkv, seq = META["n_embd"], META["n_layer"], META["n_head"], META["n_kv_head"], META["sequence_len"]
    D, T = C // H, len(idx)
    ids = torch.tensor(idx)

    def norm(x):
        return F.rms_norm(x, (x.size(-1),))

    x = norm(sd["transformer.wte.weight"][ids])
    gate = sd["smear_lambda"] * torch.sigmoid(x[1:, :24] @ sd["smear_gate.weight"].T)
    x = torch.cat([x[:1], x[1:] + gate * x[:-1]])
    x0 = x
    inv_freq = 1.0 / 100000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def rotary(z):
        z1, z2 = z[..., :D // 2], z[..., D // 2:]
        return torch.cat([z1 * cos + z2 * sin, z1 * -sin + z2 * cos], -1)

    short = -(-seq // 4 // 128) * 128
    windows = [short if META["window_pattern"][i % 4] == "S" else seq for i in range(L)]
    windows[-1] = seq
    rows, cols = torch.arange(T)[:, None], torch.arange(T)[None, :]
    for i in range(L):
        p = f"transformer.h.{i}."
        x = sd["resid_lambdas"][i] * x + sd["x0_lambdas"][i] * x0
        h = norm(x)
        q = (h @ sd[p + "attn.c_q.weight"].T).view(T, H, D)
        k = (h @ sd[p + "attn.c_k.weight"].T).view(T, Hkv, D)
        v = (h @ sd[p + "attn.c_v.weight"].T).view(T, Hkv, D)
        if f"value_embeds.{i}" + ".weight" in sd:
            ve = sd[f"value_embeds.{i}.weight"][ids].view(T, Hkv, D)
            v = v + 3 * torch.sigmoid(h[:, :12] @ sd[p + "attn.ve_gate.weight"].T)[..., None] * ve
        q, k = norm(rotary(q)) * 1.2, norm(rotary(k)) * 1.2
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        allowed = (cols <= rows) & (rows - cols <= windows[i])  # flash-attn window (left, 0)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        y = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
        x = x + y.reshape(T, C) @ sd[p + "attn.c_proj.weight"].T
        x = x + F.relu(norm(x) @ sd[p + "mlp.c_fc.weight"].T).square() @ sd[p + "mlp.c_proj.weight"].T
        if i == L // 2:
            backout = x
    x = norm(x - sd["backout_lambda"] * backout)
    logits = (x @ sd["lm_head.weight"].T)[:, :META["vocab_size"]]
    return 15 * torch.tanh(logits / 15)


def prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, META["vocab_size"], (n,), generator=g).tolist()


def reference_greedy(sd, ids: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(reference_logits(sd, ids + out)[-1].argmax()))
    return out
