"""Checks of the values a checkpoint gives its model, each refused naming the file's key, the value and the range.

A loader reads each field of its file through these, naming the file's key and the file
(`path`: the refusal is then a CheckpointError, itself a ValueError); ModelConfig checks
whatever a loader hands it with the same rules (no path: a plain ValueError).
"""

from __future__ import annotations

import math
import reprlib
from pathlib import Path
from typing import Any

from nanoinfer.errors import CheckpointError

# The most each of a model's dimensions (ModelConfig's field -> bound) may be. A loader checks
# each where it first reads it, before anything is sized by it: a 200-byte config.json that
# declares 10^10 layers would otherwise build a per-layer list until memory runs out. The bounds
# sit far past any real model's (the largest open ones: ~128 layers, 128 query heads, a width of
# ~16k-25k, an FFN of ~53k, heads of 256, vocabularies of ~262k), so that none is refused; and
# bounded so, every product a loader forms from them (a tensor's elements) fits in an int64.
# A context length (max_position_embeddings) sizes nothing (the engine sizes its tables by its
# KV pool), so it has no bound.
MAX_DIMENSIONS = {
    "num_layers": 1 << 12,
    "num_heads": 1 << 16,
    "num_kv_heads": 1 << 16,
    "head_dim": 1 << 16,
    "hidden_size": 1 << 20,
    "intermediate_size": 1 << 22,
    "vocab_size": 1 << 24,
    "num_experts": 1 << 12,  # (the largest MoEs route over a few hundred)
    "moe_intermediate_size": 1 << 22,
}

_SHOWN = reprlib.Repr()  # (3.11's Repr takes no keywords)
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong, _SHOWN.maxlist, _SHOWN.maxdict = 60, 60, 60, 4, 4


def shown(value: Any, limit: int = 80) -> str:
    """`repr(value)` cut to about `limit` characters: an error line names a hostile value (a
    megabyte string, a long list) without holding all of it."""
    return cut(_SHOWN.repr(value), limit)


def cut(text: str, limit: int = 160) -> str:
    """`text` (another exception's message, which may quote a whole value) cut to `limit` characters."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _refusal(problem: str, path: str | Path | None) -> ValueError:
    return ValueError(problem) if path is None else CheckpointError(path, problem)


def dimension(name: str, value: Any, path: str | Path | None = None, most: int | None = None) -> int:
    """`value`, a count or a size, if it is a positive integer (and at most `most`, where given:
    MAX_DIMENSIONS); else a ValueError naming `name` and the value (a bool, 1.5, 4096.0 or
    "4096" is no dimension)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refusal(f"{name} is {shown(value)}: expected a positive integer", path)
    if most is not None and value > most:
        raise _refusal(f"{name} is {value}: expected a positive integer of at most {most}, past which no "
                       "model comes (a corrupt or hostile file)", path)
    return value


def positive_number(name: str, value: Any, path: str | Path | None = None) -> float:
    """`value` as a float if it is a finite positive number; else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise _refusal(f"{name} is {shown(value)}: expected a positive finite number", path)
    return float(value)


def token_id(name: str, value: Any, path: str | Path | None = None) -> int:
    """`value` if it can be a token id (an integer from 0); else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _refusal(f"{name} is {shown(value)}: expected a token id (an integer from 0)", path)
    return value


def heads_share_kv_heads(path: str | Path, heads_name: str, heads: int, kv_name: str, kv_heads: int) -> None:
    """A CheckpointError, naming the file's two keys, unless the KV heads split the query heads
    into whole groups (each KV head serves one group)."""
    if heads % kv_heads:
        raise CheckpointError(path, f"{heads_name} {heads} is not a multiple of {kv_name} {kv_heads}: each KV "
                                    "head serves a whole group of query heads")
