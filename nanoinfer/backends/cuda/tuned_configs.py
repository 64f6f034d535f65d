"""Triton autotuning choices shipped per GPU model: the GEMV kernels' best configs, read from JSON.

With an empty cache a CUDA start spent most of its graph capture compiling every config of
every GEMV variant once per shape to time them (bench/RESULTS.md, "Cold start with the fused
layer parts": 38.8 s of a 58.8 s start on an H100). A GPU model that has a table here
(`nanoinfer/backends/cuda/tuned/<device file stem>.json`, written by tools/dump_tuned_configs.py after a full
tuning on that GPU; the one-row int4 kernel's by tools/sweep_int4_gemv.py, which times its
configs under CUDA graphs) compiles only the config that won there, as vLLM ships its fused-MoE
configs per device name.

Each autotuned kernel in nanoinfer.backends.cuda.gemv and int4_gemv carries `ShippedChoice(<kernel name>)` as its
`prune_configs_by={"early_config_prune": ...}` hook. Triton calls it, once per new tuning key,
with the kernel's configs and the call's arguments; it returns the one shipped config when
this device's table holds the key and that config is still one of the kernel's, else all of
them (a full tuning, as without a table). `NANOINFER_AUTOTUNE=full` ignores the tables, for
re-tuning; the default is `shipped`.

A table file:

    {"device": "NVIDIA H100 80GB HBM3", "triton": "3.6.0",
     "kernels": {"_gemv_kernel": {"key": ["N", "K", "W_BYTES", "ROWS", "NORM", "SILU"],
                                  "choices": [{"key": [1024, 3072, 2, 1, true, false, "torch.bfloat16", ...],
                                               "kwargs": {"BLOCK_N": 4, "BLOCK_K": 1024},
                                               "num_warps": 4, "num_stages": 3}, ...]}}}

A choice's `key` is the Autotuner's cache key written out: the values of the kernel's `key`
arguments, then the dtype of each tensor argument (triton/runtime/autotuner.py, `run`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from nanoinfer.errors import NanoInferError, RequestError

log = logging.getLogger(__name__)

TUNED_DIR = Path(__file__).resolve().parent / "tuned"

# NANOINFER_AUTOTUNE: `shipped` (the default) takes a shipped choice where there is one;
# `full` tunes every key over all configs, as Triton does alone (to re-tune, or to compare).
MODE_VARIABLE = "NANOINFER_AUTOTUNE"
MODES = ("shipped", "full")

KeyValue = int | bool | float | str


class TunedConfigsError(NanoInferError, ValueError):
    """A shipped table cannot be read; the message names the file and what was expected."""


class _Choice(msgspec.Struct, forbid_unknown_fields=True):
    key: list[KeyValue]
    kwargs: dict[str, int | bool]
    num_warps: int
    num_stages: int


class _Kernel(msgspec.Struct, forbid_unknown_fields=True):
    key: list[str]
    choices: list[_Choice]


class _File(msgspec.Struct, forbid_unknown_fields=True):
    device: str
    kernels: dict[str, _Kernel]
    triton: str = ""


@dataclass(frozen=True)
class ConfigChoice:
    """One config as Triton's `Config` holds it: the kernel's meta-parameters and launch shape."""

    kwargs: tuple[tuple[str, int | bool], ...]  # sorted by name
    num_warps: int
    num_stages: int

    @classmethod
    def of(cls, config: Any) -> ConfigChoice:
        """The choice a triton.Config (or anything with its kwargs, num_warps, num_stages) makes."""
        return cls(tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages)


@dataclass(frozen=True)
class KernelTable:
    """One kernel's shipped choices: the names of its Autotuner `key` (as tuned), and its cache
    key (those names' values, then the tensor arguments' dtypes) -> the config that won."""

    key_names: tuple[str, ...]
    choices: Mapping[tuple, ConfigChoice]


# kernel name -> its choices, for one GPU model
Table = Mapping[str, KernelTable]


def device_file_stem(device_name: str) -> str:
    """The file name (no suffix) of a GPU model's table: "NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3"."""
    stem = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")
    if not stem:
        raise ValueError(f"device name {device_name!r} has no letters or digits to name a table file by")
    return stem


def table_path(device_name: str, directory: Path = TUNED_DIR) -> Path:
    return directory / f"{device_file_stem(device_name)}.json"


def read_table(path: Path) -> tuple[str, Table]:
    """The device name and choices of the table file at `path`; no file, no choices. Raises
    TunedConfigsError naming the file for one that is not a table."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return "", {}
    except OSError as e:
        raise TunedConfigsError(f"{path}: cannot read the tuned-config table: {e}") from None
    try:
        parsed = msgspec.json.decode(raw, type=_File)
    except msgspec.DecodeError as e:
        raise TunedConfigsError(
            f"{path}: not a tuned-config table ({e}); expected JSON {{\"device\": str, \"kernels\": {{name: "
            f"{{\"key\": [arg names], \"choices\": [{{\"key\": [values], \"kwargs\": {{...}}, \"num_warps\": int, "
            f"\"num_stages\": int}}]}}}}}} as tools/dump_tuned_configs.py writes it") from None
    if device_file_stem(parsed.device) != path.stem:
        raise TunedConfigsError(f"{path}: holds the choices of {parsed.device!r}, whose table file is "
                                f"{device_file_stem(parsed.device)}.json")
    table = {}
    for name, kernel in parsed.kernels.items():
        choices = {}
        for choice in kernel.choices:
            key = tuple(choice.key)
            if key in choices:
                raise TunedConfigsError(f"{path}: kernel {name!r} has two choices for key {list(key)}")
            choices[key] = ConfigChoice(tuple(sorted(choice.kwargs.items())), choice.num_warps, choice.num_stages)
        table[name] = KernelTable(tuple(kernel.key), choices)
    return parsed.device, table


@functools.cache
def load_table(path: Path) -> Table:
    """`read_table(path)`'s choices, read once per process (the GEMV hooks ask once per tuning key)."""
    device, table = read_table(path)
    if table:
        log.info("gemv: shipped tuning choices for %s from %s (%d)", device, path,
                 sum(len(k.choices) for k in table.values()))
    return table


def autotune_key(key_names: Iterable[str], named_args: Mapping[str, Any], kwargs: Mapping[str, Any]) -> tuple:
    """The key Triton's Autotuner files a call's tuning under: the values of the key arguments
    it was given, then str(dtype) of every argument that has one, in argument order."""
    given = {**named_args, **kwargs}
    values = [given[name] for name in key_names if name in given]
    return tuple(values + [str(v.dtype) for v in given.values() if hasattr(v, "dtype")])


def choose(table: Table, kernel: str, configs: Sequence[Any], named_args: Mapping[str, Any],
           kwargs: Mapping[str, Any], like: Sequence[str] = ()) -> list:
    """[the shipped config] where `table` holds this call's key for `kernel` and that config is one
    of `configs`; otherwise all of `configs` (Triton tunes over them). `like`: key names whose
    values alone pick a shipped choice where the whole key has none (the first such in the
    table), so that a variant the table lacks still compiles one config."""
    shipped = table.get(kernel)
    if shipped is None:
        return list(configs)
    key = autotune_key(shipped.key_names, named_args, kwargs)
    choice = shipped.choices.get(key)
    if choice is None and like:
        given = [name for name in shipped.key_names if name in named_args or name in kwargs]  # (the key's order)
        places = [given.index(name) for name in like]
        choice = next((c for k, c in shipped.choices.items() if all(k[i] == key[i] for i in places)), None)
        if choice is not None:
            log.info("gemv: %s %s takes the shipped choice of the same %s", kernel, list(key), ", ".join(like))
    if choice is None:
        return list(configs)
    matching = [c for c in configs if ConfigChoice.of(c) == choice]
    if not matching:
        # (a table older than the kernel's config list: tuned over configs it no longer has)
        log.warning("gemv: the shipped choice %s for %s %s is not one of its configs; tuning them all",
                    choice, kernel, list(key))
        return list(configs)
    return matching[:1]


def autotune_mode() -> str:
    mode = os.environ.get(MODE_VARIABLE) or "shipped"
    if mode not in MODES:
        raise RequestError(f"{MODE_VARIABLE}={mode!r} is not an autotuning mode: expected one of {', '.join(MODES)}")
    return mode


@dataclass(frozen=True)
class ShippedChoice:
    """An Autotuner's `early_config_prune` hook: `choose` over the table of the GPU that runs the
    call (the device of its first CUDA tensor argument), unless NANOINFER_AUTOTUNE=full."""

    kernel: str
    directory: Path = TUNED_DIR
    like: tuple[str, ...] = ()  # (choose's)

    def __call__(self, configs: Sequence[Any], named_args: Mapping[str, Any], **kwargs: Any) -> list:
        if autotune_mode() == "full":
            return list(configs)
        device = next((v.device for v in named_args.values() if getattr(v, "device", None) is not None
                       and v.device.type == "cuda"), None)
        if device is None:
            return list(configs)
        import torch

        table = load_table(table_path(torch.cuda.get_device_name(device), self.directory))
        return choose(table, self.kernel, configs, named_args, kwargs, self.like)


def choices_from_cache(cache: Mapping[tuple, Any]) -> dict[tuple, ConfigChoice]:
    """An Autotuner's `.cache` (key -> best Config) as shipped choices."""
    return {tuple(key): ConfigChoice.of(config) for key, config in cache.items()}


def merge(old: Table, new: Table) -> Table:
    """`old` with `new`'s choices over it; a kernel whose key names changed keeps only `new`'s."""
    merged = dict(old)
    for name, kernel in new.items():
        before = old.get(name)
        if before is not None and before.key_names == kernel.key_names:
            kernel = KernelTable(kernel.key_names, {**before.choices, **kernel.choices})
        merged[name] = kernel
    return merged


def _json_key_value(value: Any) -> KeyValue:
    if isinstance(value, (bool, int, float, str)):
        return value
    raise TunedConfigsError(f"autotuner key value {value!r} ({type(value).__name__}) is not an int, bool, float "
                            "or str: it cannot be written to a table")


def write_table(path: Path, device_name: str, table: Table, triton_version: str = "") -> None:
    """Write `table` as the table file of `device_name` at `path`, a choice a line, sorted so that
    a re-tune diffs by the choices that changed; then read it back and compare."""
    kernels = []
    for name in sorted(table):
        kernel = table[name]
        choices = sorted(json.dumps({"key": [_json_key_value(v) for v in key], "kwargs": dict(choice.kwargs),
                                     "num_warps": choice.num_warps, "num_stages": choice.num_stages})
                         for key, choice in kernel.choices.items())
        kernels.append(f'  {json.dumps(name)}: {{"key": {json.dumps(list(kernel.key_names))}, "choices": [\n   '
                       + ",\n   ".join(choices) + "]}")
    text = (f'{{"device": {json.dumps(device_name)}, "triton": {json.dumps(triton_version)},\n "kernels": {{\n'
            + ",\n".join(kernels) + "\n }\n}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    if read_table(path) != (device_name, dict(table)):
        raise TunedConfigsError(f"{path}: the table read back differs from the one written")
