"""Hugging Face Hub model ids (`org/name[@revision]`) -> a local snapshot, through
huggingface_hub: its cache, progress bars, HF_TOKEN, HF_HUB_OFFLINE and HF_ENDPOINT.

Only what we load is downloaded: a Transformers repository's config, safetensors (and
their index), tokenizer files and chat template; from a GGUF repository the one .gguf file
asked for (`gguf_file`, which may be left out when the repository holds only one).
"""

from __future__ import annotations

import re
from pathlib import Path

from nanoinfer.errors import ModelFetchError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
# What an HF directory load reads (nanoinfer/loaders/hf.py, nanoinfer/text/tokenizer_hf.py).
HF_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json",
            "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
            "chat_template.json"]


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as `org/name[@revision]` (callers check it is not a local path)."""
    return HUB_ID.fullmatch(name) is not None


def resolve_hub_model(name: str, gguf_file: str | None = None) -> Path:
    """The local path to load for Hub id `name`: a snapshot directory, or one GGUF file."""
    try:
        import huggingface_hub as hub
        import huggingface_hub.constants  # noqa: F401 - (not loaded by the package's import)
        from huggingface_hub import errors
    except ImportError as exc:
        raise ModelFetchError(f"model {name!r} is a Hub id: loading it needs huggingface_hub "
                              "(pip install huggingface_hub)") from exc
    repo, _, revision = name.partition("@")
    revision = revision or None
    try:
        if gguf_file is None:
            files = _repo_files(hub, repo, revision)
            if "config.json" not in files:
                ggufs = sorted(f for f in files if f.endswith(".gguf"))
                if len(ggufs) != 1:
                    raise ModelFetchError(
                        f"{name}: " + (f"holds {len(ggufs)} GGUF files, pick one with --gguf-file (gguf_file=): "
                                       f"{ggufs}" if ggufs else
                                       "has neither config.json nor a .gguf file: not a model NanoInfer loads"))
                gguf_file = ggufs[0]
        if gguf_file is not None:
            return Path(hub.hf_hub_download(repo, gguf_file, revision=revision))
        return Path(hub.snapshot_download(repo, revision=revision, allow_patterns=HF_FILES))
    except errors.GatedRepoError as exc:
        raise ModelFetchError(f"{name}: the repository is gated; accept its terms on the Hub and set HF_TOKEN") from exc
    except errors.RepositoryNotFoundError as exc:
        raise ModelFetchError(f"{name}: no such repository on {hub.constants.ENDPOINT} (or it is private: set "
                              "HF_TOKEN)") from exc
    except errors.RevisionNotFoundError as exc:
        raise ModelFetchError(f"{name}: revision {revision!r} does not exist") from exc
    except errors.LocalEntryNotFoundError as exc:
        raise ModelFetchError(f"{name}: not in the Hub cache, and the Hub is unreachable or HF_HUB_OFFLINE is set: "
                              f"{exc}") from exc
    except errors.EntryNotFoundError as exc:  # (after its subclass above)
        raise ModelFetchError(f"{name}: it has no file {gguf_file!r}") from exc
    except errors.HfHubHTTPError as exc:
        raise ModelFetchError(f"{name}: the Hub answered {exc}") from exc
    except ModelFetchError:
        raise
    except Exception as exc:  # noqa: BLE001 - the HTTP client's connection errors, by many names
        raise ModelFetchError(f"{name}: could not reach the Hub at {hub.constants.ENDPOINT}: {exc!r}") from exc


def _repo_files(hub, repo: str, revision: str | None) -> list[str]:
    """The repository's files; offline, those of its snapshot in the cache (what a previous
    run fetched: a snapshot_download of the whole repository would call it incomplete)."""
    if not hub.constants.HF_HUB_OFFLINE:
        return hub.list_repo_files(repo, revision=revision)
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(hub.constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    ref = folder / "refs" / (revision or "main")
    snapshot = folder / "snapshots" / (ref.read_text().strip() if ref.is_file() else str(revision))
    if not snapshot.is_dir():
        from huggingface_hub.errors import LocalEntryNotFoundError

        raise LocalEntryNotFoundError(f"no snapshot of {repo} at {revision or 'main'} under {folder}")
    return [str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()]
