"""nanochat checkpoints: the tokenizer (nanoinfer/text/nanochat_tokenizer.py: the pickled tiktoken
encoding read by a restricted unpickler, crafted pickles refused without running,
conversations rendered to the ids nanochat's render_conversation gives) and the model
(nanoinfer/model/nanochat.py against the reference in tests/nanochat_files.py: logits, greedy
tokens through the engine, chat through LLM, bad checkpoints named)."""

import os
import pickle

import pytest
import torch

from nanoinfer.errors import CheckpointError, RequestError
from nanoinfer.text.nanochat_tokenizer import SPECIAL_TOKENS, nanochat_tokenizer
from tests.nanochat_files import META, nanochat_state, prompt, reference_greedy, reference_logits, write_checkpoint


# nanochat's SPLIT_PATTERN (tokenizer.py): GPT-4's, numbers in runs of at most two digits.
SPLIT = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|"""
         r"""\s+(?!\S)|\s+""")
MERGES = [b"th", b"he", b" t", b" th", b"the", b" the", b"at", b" c", b" cat", b"in", b"ing", b"\n\n"]


def encoding():
    """A small encoding as nanochat's RustBPETokenizer.train_from_iterator builds one: the 256
    bytes, merges in order, then the nine special tokens."""
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {bytes([b]): b for b in range(256)}
    for m in MERGES:
        ranks[m] = len(ranks)
    special = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(name="rustbpe", pat_str=SPLIT, mergeable_ranks=ranks, special_tokens=special)


def render_conversation(enc, messages: list[dict]) -> list[int]:
    """nanochat's render_for_completion (tokenizer.py), conversation without its last reply:
    the system message merged into the first user message, special tokens by id, text by
    encode_ordinary, then <|assistant_start|>."""
    sp = enc._special_tokens
    if messages[0]["role"] == "system":
        messages = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]},
                    *messages[2:]]
    ids = [sp["<|bos|>"]]
    for m in messages:
        kind = "user" if m["role"] == "user" else "assistant"
        ids += [sp[f"<|{kind}_start|>"], *enc.encode_ordinary(m["content"]), sp[f"<|{kind}_end|>"]]
    return ids + [sp["<|assistant_start|>"]]


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_nanochat_tokenizer_renders_conversations_as_nanochat(tmp_path, protocol):
    enc = encoding()
    path = tmp_path / "tokenizer.pkl"
    with open(path, "wb") as f:
        pickle.dump(enc, f, protocol=protocol)
    tok = nanochat_tokenizer(path)
    assert tok.bos_token_id == enc._special_tokens["<|bos|>"]
    assert tok.eos_token_ids == (enc._special_tokens["<|assistant_end|>"], enc._special_tokens["<|bos|>"])
    text = "the cat sat in the 12345 rings\n\nthe end"
    assert tok.encode(text) == [tok.bos_token_id] + enc.encode_ordinary(text)
    assert tok.decode(tok.encode(text)) == text
    conversations = [
        [{"role": "user", "content": "the cat?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"},
         {"role": "assistant", "content": "the cat sat"}, {"role": "user", "content": "then?"}],
    ]
    for messages in conversations:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert tok.encode(prompt, add_special_tokens=False) == render_conversation(enc, messages)
    with pytest.raises(RequestError, match="not tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


class _Shell:
    def __reduce__(self):
        return os.system, ("touch pwned",)


def test_crafted_pickles_are_refused_without_running(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(pickle.dumps(_Shell()))
    with pytest.raises(CheckpointError, match=r"global (posix|os)\.system is not part of a tiktoken encoding"):
        nanochat_tokenizer(path)
    assert not (tmp_path / "pwned").exists()
    # The right class around a state that is not an encoding's; a truncated file; a stranger's.
    enc = encoding()
    good = pickle.dumps(enc)
    path.write_bytes(good.replace(b"mergeable_ranks", b"mergeable_rankz"))
    with pytest.raises(CheckpointError, match="no tiktoken encoding state"):
        nanochat_tokenizer(path)
    path.write_bytes(good[:len(good) // 2])
    with pytest.raises(CheckpointError, match="not a pickled tiktoken encoding"):
        nanochat_tokenizer(path)
    other = type(enc)(name="x", pat_str=SPLIT, mergeable_ranks={bytes([b]): b for b in range(256)},
                              special_tokens={"<|endoftext|>": 256})
    path.write_bytes(pickle.dumps(other))
    with pytest.raises(CheckpointError, match=r"special tokens \['<\|bos\|>'"):
        nanochat_tokenizer(path)


# -- the model (nanoinfer/model/nanochat.py, nanoinfer/loaders/nanochat_checkpoint.py) ---------------------------

def test_nanochat_logits_equal_the_reference_implementation(tmp_path):
    """A whole prompt longer than the short window, through the paged forward in one step."""
    from nanoinfer.model.batch import SeqChunk, build_batch
    from nanoinfer.model.kv_cache import allocate_kv_pool
    from nanoinfer.loaders import load_model
    from nanoinfer.backends.choose import forward_of

    sd = nanochat_state()
    write_checkpoint(tmp_path / "base_checkpoints" / "d4", sd, compiled=True)
    model = load_model(tmp_path / "base_checkpoints" / "d4", device="cpu", progress=False)
    cfg = model.config
    assert (cfg.architecture, cfg.kv_extra_layers, cfg.sliding_window, cfg.windowed_layers) == \
        ("nanochat", 2, 129, (True, True, True, False))
    ids = prompt(180)
    batch = build_batch([SeqChunk(ids, 0, list(range(12)), True)], 16, logits_rows=range(len(ids)))
    ours = forward_of(cfg)(model.params, allocate_kv_pool(cfg, 12, 16, torch.float32, "cpu"), batch, cfg)
    ref = reference_logits(sd, ids)
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()


def test_nanochat_engine_greedy_equals_the_reference(tmp_path):
    """Through the engine: prompts prefilled in chunks over blocks of 4 (each chunk's first
    token smears with a predecessor written by an earlier step), decode steps, a second
    request reusing the first's cached prefix blocks, and contexts past the short window."""
    from nanoinfer.loaders import load_model
    from nanoinfer.sampling.sampler import SamplingParams
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    sd = nanochat_state()
    write_checkpoint(tmp_path / "d4", sd)
    model = load_model(tmp_path / "d4", device="cpu", progress=False)
    core = EngineCore(model, engine_config(block_size=4, num_blocks=160, max_num_batched_tokens=24,
                                           enable_prefix_caching=True))
    first = prompt(125, seed=2)
    prompts = [first, first[:60] + prompt(10, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for ids in prompts:  # (one after the other: the second finds the first's blocks cached)
        seq = core.add_request(ids, params)
        while core.has_unfinished():
            core.step()
        outs.append(seq.output_token_ids)
    assert core.stats()["prefix_cache_hits"] > 0
    assert outs == [reference_greedy(sd, ids, 12) for ids in prompts]


def test_nanochat_checkpoint_errors_are_named(tmp_path):
    from nanoinfer.loaders import load_model

    sd = nanochat_state()
    old = {k: v for k, v in sd.items() if not k.startswith(("smear", "backout"))}
    write_checkpoint(tmp_path / "old", old)
    with pytest.raises(CheckpointError, match="no smear_gate.weight: a nanochat checkpoint from before March 2026"):
        load_model(tmp_path / "old", device="cpu", progress=False)
    sd["lm_head.weight"] = sd["lm_head.weight"][:300]
    write_checkpoint(tmp_path / "cut", sd)
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' has shape \(300, 64\), expected \(320, 64\)"):
        load_model(tmp_path / "cut", device="cpu", progress=False)
    (tmp_path / "cut" / "meta_000650.json").write_text('{"model_config": {"n_layer": 4}}')
    with pytest.raises(CheckpointError, match="model_config holding"):
        load_model(tmp_path / "cut", device="cpu", progress=False)


def test_nanochat_chat_through_llm_and_the_server_from_a_nanochat_base_directory(tmp_path):
    """nanochat's layout: <base>/tokenizer/tokenizer.pkl beside <base>/chatsft_checkpoints/d4/.
    LLM.chat renders the conversation as nanochat does and continues it greedily as the
    reference model does (the model id is the checkpoint directory's name); the server
    streams the same reply."""
    from nanoinfer import LLM
    from nanoinfer.sampling.sampler import SamplingParams

    tiktoken = pytest.importorskip("tiktoken")
    ranks = {bytes([b]): b for b in range(256)}
    for m in MERGES + [bytes([97 + i % 26, 97 + (i * 7) % 26]) for i in range(40)]:
        if m not in ranks and len(ranks) < META["vocab_size"] - len(SPECIAL_TOKENS):
            ranks[m] = len(ranks)
    special = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    enc = tiktoken.Encoding(name="rustbpe", pat_str=SPLIT, mergeable_ranks=ranks, special_tokens=special)
    assert enc.n_vocab == META["vocab_size"]
    (tmp_path / "tokenizer").mkdir()
    with open(tmp_path / "tokenizer" / "tokenizer.pkl", "wb") as f:
        pickle.dump(enc, f)
    sd = nanochat_state()
    write_checkpoint(tmp_path / "chatsft_checkpoints" / "d4", sd, step=7)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat?"}]
    with LLM(tmp_path / "chatsft_checkpoints" / "d4", device="cpu", progress=False, num_blocks=64) as llm:
        assert llm.model.model_id == "d4"
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ids = render_conversation(enc, messages)
    assert list(out.prompt_token_ids) == ids
    assert list(out.outputs[0].token_ids) == reference_greedy(sd, ids, 8)

    from openai import OpenAI

    from nanoinfer.loaders import load_model
    from tests.live_server import LiveServer

    with LiveServer(load_model(tmp_path / "chatsft_checkpoints" / "d4", device="cpu", progress=False)) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        stream = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == out.outputs[0].text
