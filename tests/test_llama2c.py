"""llama2.c checkpoints (nanoinfer/loaders/llama2c.py): files written here in both export
layouts, their logits against run.c's own arithmetic (interleaved RoPE on Meta's layout, in
plain torch), their tokenizer.bin against run.c's encoder, and bad files named."""

import struct

import pytest
import torch

from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.errors import CheckpointError
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.loaders import load_model
from nanoinfer.model.decoder import forward

DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ = 32, 48, 2, 4, 2, 300, 64
HS = DIM // HEADS


def random_weights(shared: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """llama2.c's tensors (Meta's layout: wq/wk rows rotate in adjacent pairs)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    w = {"embed": r(VOCAB, DIM, scale=1.0), "attn_norm": 1 + r(LAYERS, DIM), "ffn_norm": 1 + r(LAYERS, DIM),
         "wq": r(LAYERS, DIM, DIM), "wk": r(LAYERS, KV_HEADS * HS, DIM), "wv": r(LAYERS, KV_HEADS * HS, DIM),
         "wo": r(LAYERS, DIM, DIM), "w1": r(LAYERS, HIDDEN, DIM), "w2": r(LAYERS, DIM, HIDDEN),
         "w3": r(LAYERS, HIDDEN, DIM), "final_norm": 1 + r(DIM)}
    w["classifier"] = w["embed"] if shared else r(VOCAB, DIM)
    return w


def export(path, w: dict[str, torch.Tensor], version: int, shared: bool) -> None:
    """As llama2.c's export.py writes a model: legacy_export (0) or version1_export (1)."""
    def f32(*names):
        return b"".join(w[n].float().contiguous().numpy().astype("<f4").tobytes() for n in names)

    dims = (DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB if shared else -VOCAB, SEQ)
    with open(path, "wb") as f:
        if version == 0:
            f.write(struct.pack("<7i", *dims))
            f.write(f32("embed", "attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3", "final_norm"))
            f.write(torch.zeros(2 * SEQ * HS // 2).numpy().astype("<f4").tobytes())  # freq_cis_real, imag
        else:
            header = struct.pack("<Ii7iB", 0x616B3432, 1, *(abs(d) for d in dims), int(shared))
            f.write(header + b"\0" * (256 - len(header)))
            f.write(f32("attn_norm", "ffn_norm", "final_norm", "embed", "wq", "wk", "wv", "wo", "w1", "w2", "w3"))
        if not shared:
            f.write(f32("classifier"))


def run_c_logits(w: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """run.c's forward over a whole prompt (fp32, no cache): every position's logits."""
    def rmsnorm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight

    def rope(v, heads):  # adjacent pairs (2j, 2j+1) of each head turn by pos / 10000^(2j/HS)
        t = torch.arange(v.shape[0], dtype=torch.float32)[:, None, None]
        freq = 1.0 / 10000 ** (torch.arange(0, HS, 2, dtype=torch.float32) / HS)
        pairs = v.view(v.shape[0], heads, HS // 2, 2)
        cos, sin = torch.cos(t * freq), torch.sin(t * freq)
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).view(v.shape[0], heads, HS)

    T = len(tokens)
    x = w["embed"][tokens]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(LAYERS):
        h = rmsnorm(x, w["attn_norm"][i])
        q, k = rope(h @ w["wq"][i].T, HEADS), rope(h @ w["wk"][i].T, KV_HEADS)
        v = (h @ w["wv"][i].T).view(T, KV_HEADS, HS)
        group = HEADS // KV_HEADS  # (run.c: query head h reads kv head h / kv_mul)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / HS ** 0.5
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
        x = x + attn.reshape(T, DIM) @ w["wo"][i].T
        h = rmsnorm(x, w["ffn_norm"][i])
        x = x + (torch.nn.functional.silu(h @ w["w1"][i].T) * (h @ w["w3"][i].T)) @ w["w2"][i].T
    return rmsnorm(x, w["final_norm"]) @ w["classifier"].T


def our_logits(model, tokens: list[int]) -> torch.Tensor:
    cfg = model.config
    batch = build_batch([SeqChunk(tokens, 0, list(range(4)), True)], 16, logits_rows=range(len(tokens)))
    return forward(model.params, allocate_kv_pool(cfg, 4, 16, torch.float32, "cpu"), batch, cfg)


@pytest.mark.parametrize("version,shared", [(0, True), (0, False), (1, True), (1, False)])
def test_llama2c_checkpoint_logits_equal_run_c(tmp_path, version, shared):
    w = random_weights(shared)
    path = tmp_path / "model.bin"
    export(path, w, version, shared)
    model = load_model(path, device="cpu", dtype="float32", progress=False)
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size, cfg.max_position_embeddings) == (DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ)
    assert cfg.tie_word_embeddings is shared and model.tokenizer is None  # (no tokenizer.bin beside it)
    tokens = [1, 17, 250, 3, 99, 42, 7, 18, 200, 5, 66, 123]
    ours, ref = our_logits(model, tokens), run_c_logits(w, tokens)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# -- tokenizer.bin ------------------------------------------------------------------------------

PIECES = ["▁the", "▁cat", "▁sat", "th", "he", "▁t", "at", "▁c", "▁s", "ca", "▁on", "on", "▁m", "at▁", "▁mat"]


def vocab() -> tuple[list[str], list[float]]:
    """A small SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, the letters,
    then merged pieces (scores: later pieces merge first, as SentencePiece ranks them)."""
    pieces = ["<unk>", "\n<s>\n", "\n</s>\n"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁"] + list("abcdefghijklmnopqrstuvwxyz") + [p for p in PIECES if p not in ("at▁",)]
    pieces += ["▁" + str(i) for i in range(VOCAB - len(pieces))]  # (pad to the model's vocabulary)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    return pieces, scores


def write_tokenizer(path, pieces, scores) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<i", max(len(p.encode()) for p in pieces)))
        for piece, score in zip(pieces, scores):
            raw = piece.replace("▁", " ").encode()
            f.write(struct.pack("<fi", score, len(raw)) + raw)


def run_c_encode(text: str, pieces: list[str], scores: list[float]) -> list[int]:
    """run.c's encode(bos=1, eos=0): a dummy space prefix, one token per UTF-8 character (its
    bytes + 3 where the character is not a piece), then merge the best-scored adjacent pair
    until none is a piece."""
    lookup = {p.replace("▁", " "): i for i, p in enumerate(pieces) if i > 2}
    ids = [lookup[c] if c in lookup else None for c in " " + text]
    tokens = []
    for c, i in zip(" " + text, ids):
        tokens += [i] if i is not None else [b + 3 for b in c.encode()]
    text_of = {i: p for p, i in lookup.items()}
    while True:
        best = max(((scores[lookup[m]], j, lookup[m]) for j in range(len(tokens) - 1)
                    if (m := text_of[tokens[j]] + text_of[tokens[j + 1]]) in lookup), default=None,
                   key=lambda c: (c[0], -c[1]))
        if best is None:
            return [1] + tokens
        _, j, merged = best
        tokens[j:j + 2] = [merged]


def test_llama2c_tokenizer_encodes_as_run_c_and_decodes_back(tmp_path):
    w = random_weights(shared=True)
    export(tmp_path / "model.bin", w, 0, True)
    pieces, scores = vocab()
    write_tokenizer(tmp_path / "tokenizer.bin", pieces, scores)
    tok = load_model(tmp_path / "model.bin", device="cpu", dtype="float32", progress=False).tokenizer
    assert tok is not None and tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    for text in ["the cat sat on the mat", "hat", "thé cat ✓", "a  b", "Mat"]:
        assert tok.encode(text) == run_c_encode(text, pieces, scores), text
        assert tok.decode(tok.encode(text)) == text


def test_bad_llama2c_files_are_named(tmp_path):
    w = random_weights(shared=True)
    path = tmp_path / "model.bin"
    export(path, w, 0, True)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(path, device="cpu", progress=False)
    path.write_bytes(struct.pack("<Ii7iB", 0x616B3432, 2, *([8] * 7), 1) + b"\0" * 300)
    with pytest.raises(CheckpointError, match="version 2 is not supported|export version 2"):
        load_model(path, device="cpu", progress=False)
    path.write_bytes(struct.pack("<7i", 30, 48, 2, 4, 2, 300, 64) + b"\0" * 64)
    with pytest.raises(CheckpointError, match="dim=30.*divisible"):
        load_model(path, device="cpu", progress=False)
    export(path, w, 0, True)
    (tmp_path / "tokenizer.bin").write_bytes(struct.pack("<i", 8) + struct.pack("<fi", 0.0, 50) + b"ab")
    with pytest.raises(CheckpointError, match="token 0 of the 300"):
        load_model(path, device="cpu", progress=False)
