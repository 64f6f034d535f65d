"""Settings defined once: a dataclass field declared with `setting(...)` is a keyword argument,
a command-line flag and a checked value, all from that one declaration.

    @dataclass(frozen=True)
    class EngineConfig:
        block_size: int = setting(16, "tokens per KV block", minimum=1)
        def __post_init__(self):
            check_settings(self)

`check_settings` raises RequestError naming the value and what was expected; nanoinfer/flags.py
puts the fields on a command line (`--block-size`, booleans as `--x/--no-x`, sizes such as `4GiB`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, Iterable

from nanoinfer.errors import RequestError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from `4GiB`, `512MiB`, `2G`, `1048576` or `1.5e9` (a bare number is bytes)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    try:
        return int(float(text))  # (YAML reads 1.5e9 as a string)
    except ValueError:
        pass
    match = _SIZE.match(str(text))
    if match is None:
        raise RequestError(f"size {text!r} is invalid: expected bytes, or a number with KiB, MiB, GiB or TiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def json_object(value: Any, name: str, expected: str, param: str | None = None) -> dict:
    """`value` (a dict, or its JSON text: a CLI flag, a request field) as a dict; RequestError
    naming `name` and what was `expected` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise RequestError(f"{name}={value!r} is not valid JSON: {exc}", param=param or name) from exc
    if not isinstance(value, dict):
        raise RequestError(f"{name}={value!r} is invalid: expected {expected}", param=param or name)
    return value


def float32_in(value, low: float = -math.inf, high: float = math.inf, *, low_open: bool = False) -> bool:
    """Whether `value` is a real number that, rounded to float32 (the precision the sampler
    computes in), is finite and in [low, high] — (low, high] with `low_open`. A check in
    float64 passes 1e-50 as a top-p or a penalty, which then reaches the sampler as 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        x = struct.unpack("f", struct.pack("f", float(value)))[0]  # past float32's range: inf
    except OverflowError:  # an int past any float's range
        return False
    return math.isfinite(x) and (low < x if low_open else low <= x) and x <= high


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"  # (an int bound exactly: a seed's 2**63 - 1)


@dataclass(frozen=True)
class Spec:
    """What a setting accepts. Numbers are checked as float32 too where `float32` is set: a
    value the sampler would round to 0 or infinity must fail here, not emit garbage later."""

    help: str
    minimum: float | None = None  # inclusive
    above: float | None = None  # exclusive lower bound
    maximum: float | None = None  # inclusive
    choices: tuple | None = None
    optional: bool = False  # None is allowed (it means "automatic" or "off")
    size: bool = False  # bytes; the flag and the keyword also take "4GiB"
    float32: bool = False
    repeated: bool = False  # a tuple of strings; the flag may be given several times
    flag: bool = True  # on the command line
    parse: Any = None  # (name, value) -> the value as held, or RequestError: a structured setting (a JSON flag)
    check: Any = None  # (name, value) -> None, or RequestError: what the bounds above cannot say (a path exists)

    def expected(self, kind: type) -> str:
        if self.choices is not None:
            text = f"one of {list(self.choices)}"
        else:
            text = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))
            low = self.above if self.above is not None else self.minimum
            opening = "(" if self.above is not None else "["
            if low is not None and self.maximum is not None:
                text += f" in {opening}{_number(low)}, {_number(self.maximum)}]"
            elif low is not None:
                text += f" {'>' if self.above is not None else '>='} {_number(low)}"
            elif self.maximum is not None:
                text += f" <= {_number(self.maximum)}"
            if self.float32:
                text += " (in float32)"
            if self.size:
                text += ", or a size such as 4GiB"
            if self.repeated:
                text = "strings"
        return text + (" or None" if self.optional else "")


def setting(default: Any, help: str, **spec) -> Any:
    """A dataclass field that is also a flag and a check (see the module docstring)."""
    return dataclasses.field(default=default, metadata={"setting": Spec(help, **spec)})


def _kind(cls, f: dataclasses.Field) -> type:
    """The field's Python type, from its default or its annotation."""
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if re.match(rf"^{name}\b", annotation):
            return kind
    return type(f.default) if f.default is not None else str


def specs(cls) -> Iterable[tuple[dataclasses.Field, Spec, type]]:
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("setting")
        if spec is not None:
            yield f, spec, _kind(cls, f)


def check_value(name: str, value: Any, spec: Spec, kind: type) -> Any:
    """`value` as the setting holds it (a size parsed), or RequestError naming it."""
    def fail():
        raise RequestError(f"{name}={value!r} is invalid: expected {spec.expected(kind)}", param=name)

    if spec.parse is not None:
        return spec.parse(name, value)
    if value is None:
        return None if spec.optional else fail()
    if spec.repeated:
        values = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
        return values if values is not None and all(isinstance(v, str) for v in values) else fail()
    if spec.size and isinstance(value, (str, float)):
        try:
            value = parse_size(value)
        except RequestError:
            fail()
    if kind is bool:
        return value if isinstance(value, bool) else fail()
    if isinstance(value, bool) or (kind in (int, float) and not isinstance(value, (int, float))):
        fail()
    if kind is int and not isinstance(value, int):
        fail()
    if kind is str and not isinstance(value, str):
        fail()
    if spec.choices is not None and value not in spec.choices:
        fail()
    if kind in (int, float):
        low = spec.above if spec.above is not None else spec.minimum
        low = -math.inf if low is None else low
        high = math.inf if spec.maximum is None else spec.maximum
        low_open = spec.above is not None
        if spec.float32:
            ok = float32_in(value, low, high, low_open=low_open)
        else:
            finite = isinstance(value, int) or math.isfinite(value)
            ok = finite and (low < value if low_open else low <= value) and value <= high
        if not ok:
            fail()
    if spec.check is not None:
        spec.check(name, value)
    return value


def check_settings(obj) -> None:
    """Check (and normalize: sizes to bytes) every `setting` field of a frozen dataclass."""
    for f, spec, kind in specs(type(obj)):
        value = check_value(f.name, getattr(obj, f.name), spec, kind)
        object.__setattr__(obj, f.name, value)


def setting_names(cls) -> list[str]:
    return [f.name for f, _, _ in specs(cls)]


def split_kwargs(kwargs: dict, *classes, what: str) -> list[dict]:
    """Route flat keyword arguments to the dataclasses that declare them; an unknown name is a
    RequestError listing the known ones."""
    parts: list[dict] = [{} for _ in classes]
    for name, value in kwargs.items():
        for part, cls in zip(parts, classes):
            if name in setting_names(cls):
                part[name] = value
                break
        else:
            known = sorted(n for cls in classes for n in setting_names(cls))
            raise RequestError(f"unknown {what} argument {name!r}: expected one of {known}", param=name)
    return parts
