"""A fake Hugging Face Hub on 127.0.0.1 for tests: local directories served as model repositories
to huggingface_hub (2.4.0) over plain HTTP, every request recorded.

    import huggingface_hub
    from tests.fake_hub import FakeHub, point_hub_at

    @pytest.fixture
    def fake_hub(tmp_path, monkeypatch):
        main = tmp_path / "main"  # config.json, model.safetensors, tokenizer.json, ...
        with FakeHub({"org/tiny": {"main": main, "v1": tmp_path / "v1"}}) as hub:
            point_hub_at(monkeypatch, hub.url, home=tmp_path / "hf_home")
            yield hub

    def test_fetch(fake_hub):
        snapshot = huggingface_hub.snapshot_download("org/tiny", allow_patterns=["*.json"])
        sha = FakeHub.commit_sha("org/tiny", "main")
        assert ("GET", f"/org/tiny/resolve/{sha}/config.json") in fake_hub.requests

huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_HUB_DISABLE_XET and
HF_HUB_DISABLE_TELEMETRY into `huggingface_hub.constants` when it is imported, so setting them in a test
does nothing in this process: point_hub_at patches the constants (and `huggingface_hub.hf_api.api`, the
HfApi that `huggingface_hub.list_repo_files` / `model_info` are bound to), and sets the environment only
for subprocesses. The cache is the caller's: pass `home=` (a tmp dir) or patch
`huggingface_hub.constants.HF_HUB_CACHE` yourself, never leave the real ~/.cache/huggingface in play.
Offline mode in-process: `monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)`
(HF_HUB_OFFLINE=1 works only in the environment of a process that has not imported huggingface_hub yet).
A token: `monkeypatch.setenv("HF_TOKEN", ...)` after point_hub_at (HF_TOKEN is read at each call), or token=.

What the client asks (huggingface_hub 2.4.0) and this server answers:
  GET /api/models/{repo}[/revision/{rev}]      model info: `sha` (the commit), `siblings`
  GET /api/models/{repo}/tree/{rev}[/{path}]    ?recursive=true: the file list (snapshot_download, list_repo_files)
  HEAD, GET /{repo}/resolve/{rev}/{file}        X-Repo-Commit, ETag (X-Linked-Etag/-Size for LFS-like files),
                                                Content-Length; the body on GET (Range honoured)
snapshot_download resolves the revision with the model-info call, lists the tree at the commit sha, then
HEADs and GETs each file that its patterns allow at that sha. A file downloads over Xet only when a HEAD
answer carries X-Xet-Hash (or the tree an `xetHash`); this server sends neither, so downloads are plain GETs.
Errors carry the X-Error-Code that huggingface_hub maps: RepoNotFound -> RepositoryNotFoundError,
RevisionNotFound -> RevisionNotFoundError, EntryNotFound -> RemoteEntryNotFoundError (an EntryNotFoundError),
GatedRepo (401, no token) -> GatedRepoError (a RepositoryNotFoundError); a wrong token gets the Hub's 401
"Invalid credentials in Authorization header" -> a plain HfHubHTTPError with status 401.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    import pytest

# Matched against the raw (still quoted) path: the client quotes revisions with safe="", so a
# revision such as refs/pr/1 arrives as one segment, refs%2Fpr%2F1. Repo ids are `name` or `org/name`.
API_PATH = re.compile(r"/api/models/(?P<repo>[^/]+(?:/[^/]+)?)"
                      r"(?:/revision/(?P<rev>[^/]+)|/tree/(?P<tree_rev>[^/]+)(?:/(?P<tree_path>.+))?)?")
RESOLVE_PATH = re.compile(r"/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")
# Files the Hub would keep in LFS: their etag is the content's sha256 (so is the cache's blob name).
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")


def _error(status: int, code: str | None, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An error as the Hub sends it: the client reads X-Error-Code to pick the exception."""
    return JSONResponse({"error": message}, status,
                        {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(headers or {})})


def _entry(path: str, file: Path) -> dict[str, Any]:
    """A tree entry: `oid` is the git blob sha1; LFS-like files also get their sha256."""
    data = file.read_bytes()
    entry: dict[str, Any] = {"type": "file", "path": path, "size": len(data),
                             "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
    if path.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


class FakeHub:
    """Serves `{repo_id: {revision: directory}}`; `.url`, `.requests` ((method, decoded path) per request)."""

    def __init__(self, repos: Mapping[str, Mapping[str, str | Path]], token: str | None = None) -> None:
        self.repos = {repo: {rev: Path(root) for rev, root in revs.items()} for repo, revs in repos.items()}
        self.token = token
        self.requests: list[tuple[str, str]] = []
        self.url = ""
        app = Starlette(routes=[Route("/{path:path}", self._serve, methods=["GET", "HEAD"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @staticmethod
    def commit_sha(repo_id: str, revision: str) -> str:
        """The fixed fake commit of a revision (40 hex, as the client checks)."""
        return hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()

    def __enter__(self) -> FakeHub:
        from tests.live_server import start_in_thread

        self.url = start_in_thread(self._server, self._thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def _lookup(self, repo: str, rev: str) -> tuple[str, dict[str, Path]] | Response:
        """(commit sha, {repo path: local file}) of a revision given by name or by its sha."""
        if repo not in self.repos:
            return _error(404, "RepoNotFound", "Repository not found")
        for name, root in self.repos[repo].items():
            sha = self.commit_sha(repo, name)
            if rev in (name, sha):
                return sha, {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}
        return _error(404, "RevisionNotFound", f"Invalid rev id: {rev}")

    def _serve(self, request: Request) -> Response:  # sync: starlette runs it in its thread pool
        self.requests.append((request.method, request.url.path))
        raw = request.scope["raw_path"].decode()
        api, resolve = API_PATH.fullmatch(raw), RESOLVE_PATH.fullmatch(raw)
        match = api or resolve
        if match is None:
            return _error(404, None, "Not Found")
        repo = unquote(match["repo"])
        if self.token is not None:
            auth = request.headers.get("authorization")
            if auth is None:
                return _error(401, "GatedRepo", f"Access to model {repo} is restricted. You must have access to it "
                                                "and be authenticated to access it. Please log in.")
            if auth != f"Bearer {self.token}":
                return _error(401, None, "Invalid credentials in Authorization header")
        rev = unquote((match["rev"] if resolve else match["rev"] or match["tree_rev"]) or "main")
        found = self._lookup(repo, rev)
        if isinstance(found, Response):
            return found
        sha, files = found
        if resolve:
            path = unquote(match["file"])
            if path not in files:  # X-Repo-Commit lets the client cache the absence (.no_exist)
                return _error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": sha})
            entry = _entry(path, files[path])
            headers = {"X-Repo-Commit": sha, "ETag": f'"{entry["oid"]}"'}
            if "lfs" in entry:
                headers |= {"X-Linked-Etag": f'"{entry["lfs"]["oid"]}"', "X-Linked-Size": str(entry["size"])}
            return FileResponse(files[path], headers=headers)  # our ETag wins over its stat-based one
        if match["tree_rev"] is None:
            return JSONResponse(self._model_info(repo, sha, files, request.query_params.get("blobs") == "true"))
        prefix = unquote(match["tree_path"] or "").strip("/")
        tree = self._tree(files, prefix, request.query_params.get("recursive") == "true")
        if prefix and not tree:
            return _error(404, "EntryNotFound", f"{prefix} does not exist on \"{rev}\"", {"X-Repo-Commit": sha})
        return JSONResponse(tree)

    def _model_info(self, repo: str, sha: str, files: Mapping[str, Path], blobs: bool) -> dict[str, Any]:
        siblings = []
        for path, file in files.items():
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:  # files_metadata=True
                entry = _entry(path, file)
                sibling |= {"size": entry["size"], "blobId": entry["oid"]}
                if "lfs" in entry:
                    sibling["lfs"] = {"sha256": entry["lfs"]["oid"], "size": entry["size"], "pointerSize": 134}
            siblings.append(sibling)
        return {"_id": sha[:24], "id": repo, "modelId": repo, "sha": sha, "private": self.token is not None,
                "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                "lastModified": "2024-01-01T00:00:00.000Z", "siblings": siblings}

    @staticmethod
    def _tree(files: Mapping[str, Path], prefix: str, recursive: bool) -> list[dict[str, Any]]:
        """The entries under `prefix`: its children, or with `recursive` every file and folder below it."""
        base = f"{prefix}/" if prefix else ""
        entries, folders = [], set()
        for path, file in files.items():
            if not path.startswith(base):
                continue
            parts = path[len(base):].split("/")
            depth = len(parts) if recursive else min(2, len(parts))  # folders on the way to the file
            folders.update(base + "/".join(parts[:i]) for i in range(1, depth))
            if recursive or len(parts) == 1:
                entries.append(_entry(path, file))
        return [{"type": "directory", "path": folder, "size": 0, "oid": hashlib.sha1(folder.encode()).hexdigest()}
                for folder in sorted(folders)] + entries


def point_hub_at(monkeypatch: pytest.MonkeyPatch, url: str, *, home: str | Path | None = None) -> None:
    """Make huggingface_hub in this process (and subprocesses' environment) use the Hub at `url`,
    online, without Xet, telemetry or an ambient HF_TOKEN; with `home`, also its cache and token files."""
    import huggingface_hub.constants as constants
    from huggingface_hub import hf_api

    for name, value in {"HF_ENDPOINT": url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    # huggingface_hub.list_repo_files, model_info, ... are bound to this instance, built at import.
    monkeypatch.setattr(hf_api.api, "endpoint", url)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    # With telemetry on, building the user agent fetches {ENDPOINT}/api/agent-harnesses.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    if home is not None:
        home = Path(home)
        monkeypatch.setenv("HF_HOME", str(home))
        monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
        for name, path in {"HF_HOME": home, "HF_HUB_CACHE": home / "hub", "HF_ASSETS_CACHE": home / "assets",
                           "HF_XET_CACHE": home / "xet", "HF_TOKEN_PATH": home / "token",
                           "HF_STORED_TOKENS_PATH": home / "stored_tokens"}.items():
            monkeypatch.setattr(constants, name, str(path))
