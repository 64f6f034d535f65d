"""A checkpoint's recommended sampling settings: the defaults of requests that do not set their own.

Model makers ship them — an HF directory's `generation_config.json`, a GGUF's `general.sampling.*`
keys — and vLLM (`--generation-config auto`) and llama.cpp apply them unless told otherwise; so
does NanoInfer (LoadConfig.generation_config: "auto", "none", or a folder holding a
generation_config.json). Only the fields whose meaning is SamplingParams' are read, as vLLM reads
them (HF's `do_sample` is not: a file that names a temperature means it). A value SamplingParams
refuses is a CheckpointError naming the file and the field.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping

from nanoinfer.errors import CheckpointError, RequestError
from nanoinfer.json_files import read_json_object
from nanoinfer.sampling.sampling_params import SamplingParams

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
# generation_config.json's field -> SamplingParams' (transformers' names; max_new_tokens is max_tokens)
HF_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# llama.cpp's recommended-sampler keys (gguf.Keys.General.SAMPLING_*) -> SamplingParams'
GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
               "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
               "general.sampling.penalty_repeat": "repetition_penalty"}


def checked(defaults: Mapping[str, Any], path) -> dict[str, Any]:
    """`defaults` as SamplingParams keywords, each value one SamplingParams accepts."""
    try:
        SamplingParams(**defaults)
    except (RequestError, TypeError) as exc:
        raise CheckpointError(path, f"its recommended sampling settings are not usable: {exc}") from exc
    return dict(defaults)


def from_generation_config(folder: Path) -> dict[str, Any]:
    """The defaults in `folder`'s generation_config.json ({} when it has none)."""
    path = folder / GENERATION_CONFIG
    if not path.is_file():
        return {}
    raw = read_json_object(path)
    return checked({ours: raw[theirs] for theirs, ours in HF_FIELDS.items() if raw.get(theirs) is not None}, path)


def from_gguf(field: Callable[[str], Any], path) -> dict[str, Any]:
    """The defaults among a GGUF file's metadata (`field(key)`: its value, or None)."""
    found = {ours: field(key) for key, ours in GGUF_FIELDS.items()}
    return checked({k: v for k, v in found.items() if v is not None}, path)


def check_setting(name: str, setting: str) -> None:
    """A `generation_config` value is auto, none, or a folder holding a generation_config.json."""
    if setting not in ("auto", "none") and not (Path(setting).expanduser() / GENERATION_CONFIG).is_file():
        raise RequestError(f"{name}={setting!r}: expected auto, none, or a folder holding a {GENERATION_CONFIG}",
                           param=name)


def resolve(setting: str, checkpoint: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """What `generation_config` (checked by check_setting) asks for: "auto", the checkpoint's own
    (`checkpoint()`); "none", nothing; else the generation_config.json of the folder it names."""
    if setting == "none":
        return {}
    defaults = checkpoint() if setting == "auto" else from_generation_config(Path(setting).expanduser())
    if defaults:  # (said, as vLLM says it: a request's sampling now depends on the model it runs on)
        log.info("requests that do not set them take the model's recommended sampling settings %s "
                 "(generation_config='none' keeps NanoInfer's own)", defaults)
    return defaults


def default_params(defaults: Mapping[str, Any]) -> SamplingParams:
    """A request's SamplingParams when it names none: the model's recommended settings, else NanoInfer's."""
    return SamplingParams(**defaults)
