"""nanochat checkpoints, the tokenizer side (nanoinfer/nanochat_tokenizer.py): the pickled
tiktoken encoding read by a restricted unpickler, crafted pickles refused without running,
and conversations rendered to the ids nanochat's own render_conversation gives."""

import os
import pickle

import pytest

from nanoinfer.errors import CheckpointError, RequestError
from nanoinfer.nanochat_tokenizer import SPECIAL_TOKENS, nanochat_tokenizer

tiktoken = pytest.importorskip("tiktoken")

# nanochat's SPLIT_PATTERN (tokenizer.py): GPT-4's, numbers in runs of at most two digits.
SPLIT = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|"""
         r"""\s+(?!\S)|\s+""")
MERGES = [b"th", b"he", b" t", b" th", b"the", b" the", b"at", b" c", b" cat", b"in", b"ing", b"\n\n"]


def encoding() -> "tiktoken.Encoding":
    """A small encoding as nanochat's RustBPETokenizer.train_from_iterator builds one: the 256
    bytes, merges in order, then the nine special tokens."""
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
    other = tiktoken.Encoding(name="x", pat_str=SPLIT, mergeable_ranks={bytes([b]): b for b in range(256)},
                              special_tokens={"<|endoftext|>": 256})
    path.write_bytes(pickle.dumps(other))
    with pytest.raises(CheckpointError, match=r"special tokens \['<\|bos\|>'"):
        nanochat_tokenizer(path)
