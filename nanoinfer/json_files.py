"""Read a JSON file that must hold an object (a checkpoint's config, index, tokenizer and generation configs).

A file that is not JSON, nests past the parser's recursion limit, holds a number of more digits
than Python parses, or holds a list or a number where an object belongs, is a CheckpointError
naming the file and what it holds, never a traceback from the parser or from the code that
reads its fields. A leaf module (it imports only nanoinfer.errors): the tokenizer and the
loaders both read their files through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nanoinfer.errors import CheckpointError


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, as an error names it ("a list" where an object belongs)."""
    kinds = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
             bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def read_json_object(path: Path, what: str = "a JSON object") -> dict:
    """The object `path` holds; `what` names what was expected in the error."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the file: {exc}") from exc
    except RecursionError:  # (the parser recurses once per [ or {: 200 KB of brackets is enough)
        raise CheckpointError(path, "not usable JSON: it nests too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:  # (JSONDecodeError; an int past 4300 digits is a ValueError)
        raise CheckpointError(path, f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointError(path, f"holds {json_kind(value)}, expected {what}")
    return value
