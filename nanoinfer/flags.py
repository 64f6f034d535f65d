"""Command-line flags from `setting` declarations (nanoinfer/settings.py): `add_flags` puts a
dataclass's settings on an argparse parser, `from_namespace` reads them back, and
`parse_config_file` reads `--config FILE`. Only the command line (runtime/cli.py) imports it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Iterable

from nanoinfer.errors import RequestError
from nanoinfer.settings import specs


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser, cls, *, only: Iterable[str] | None = None, defaults: dict | None = None,
              unset: dict[str, str] | None = None) -> None:
    """One flag per `setting` field of `cls` (or those named in `only`), help and default
    from the declaration (`defaults` overrides some, e.g. a CLI's own sampling defaults).
    `unset`: flags left out of the namespace unless given (on the command line or in --config),
    each with what applies instead for its help (a model's recommended sampling settings)."""
    defaults, unset = defaults or {}, unset or {}
    wanted = None if only is None else set(only)
    for f, spec, kind in specs(cls):
        if not spec.flag or (wanted is not None and f.name not in wanted):
            continue
        default = argparse.SUPPRESS if f.name in unset else defaults.get(f.name, f.default)
        help_text = f"{spec.help} (default: {unset[f.name]})" if f.name in unset else spec.help
        kw: dict[str, Any] = dict(default=default, help=help_text, dest=f.name)
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif spec.repeated:
            kw["action"] = _Repeated
            kw["metavar"] = f.name.upper()
        elif spec.size:
            kw["type"] = str
            kw["metavar"] = "BYTES"
        elif spec.parse is not None:
            kw["type"] = str
            kw["metavar"] = "JSON"
        else:
            kw["type"] = kind
            if spec.choices is not None:
                kw["choices"] = list(spec.choices)
        parser.add_argument(flag_name(f.name), **kw)


class _Repeated(argparse.Action):
    """A flag given several times collects its values; given at all, it replaces the default
    (a value from --config) rather than adding to it: the command line wins."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        first = current is self.default  # (argparse puts the default object itself there)
        setattr(namespace, self.dest, (values,) if first else (*current, values))


def from_namespace(cls, args: argparse.Namespace) -> dict:
    """The keyword arguments of `cls` that `add_flags` put on the parser."""
    return {f.name: getattr(args, f.name) for f, spec, _ in specs(cls) if hasattr(args, f.name)}


def parse_config_file(path: str, valid: Iterable[str]) -> dict:
    """`--config FILE`: a JSON or YAML mapping of flag names (dashes or underscores) to values."""
    import yaml  # (only a --config file in YAML needs it)

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = yaml.safe_load(text) if path.endswith((".yaml", ".yml")) else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise RequestError(f"config file {path}: {exc}", param="config") from exc
    if not isinstance(data, dict):
        raise RequestError(f"{path}: expected a mapping of flag names to values, got {type(data).__name__}")
    valid = set(valid)
    out = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in valid:
            raise RequestError(f"{path}: unknown setting {key!r}: expected one of "
                               f"{sorted(n.replace('_', '-') for n in valid)}", param=str(key))
        out[name] = value
    return out

