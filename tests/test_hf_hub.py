"""Hub model ids (nanoinfer/loaders/hf_hub.py) against a fake Hub on 127.0.0.1
(tests/fake_hub.py): huggingface_hub's own client over real HTTP, only the files we load
fetched, revisions, a GGUF repository's file choice, tokens, offline mode, clear errors,
and the CLI in its own process pointed at the fake Hub by HF_ENDPOINT."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

huggingface_hub = pytest.importorskip("huggingface_hub")

from nanoinfer.errors import ModelFetchError  # noqa: E402
from nanoinfer.loaders import load_model  # noqa: E402
from tests.fake_hub import FakeHub, point_hub_at  # noqa: E402
from tests.test_gguf_formats import hf_model, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """org/tiny: a Transformers directory (plus a README and weights we never load) at main,
    another model at v1; org/tiny-gguf: two GGUF files of the same model."""
    root = tmp_path_factory.mktemp("repos")
    models = {}
    for rev, seed in (("main", 0), ("v1", 1)):
        model = hf_model("llama", tied=False, seed=seed)
        model.save_pretrained(root / "tiny" / rev)
        (root / "tiny" / rev / "README.md").write_text("# tiny\n")
        (root / "tiny" / rev / "pytorch_model.bin").write_bytes(b"not loaded")
        models[rev] = model
    (root / "gguf").mkdir()
    write_gguf(models["main"], root / "gguf" / "tiny-f32.gguf", "llama")
    shutil.copy(root / "gguf" / "tiny-f32.gguf", root / "gguf" / "tiny-copy.gguf")
    return root, models


@pytest.fixture
def hub(repos, tmp_path, monkeypatch):
    root, _ = repos
    layout = {"org/tiny": {"main": root / "tiny" / "main", "v1": root / "tiny" / "v1"},
              "org/tiny-gguf": {"main": root / "gguf"}}
    with FakeHub(layout) as fake:
        point_hub_at(monkeypatch, fake.url, home=tmp_path / "hf_home")
        yield fake


def first_logits(model, tokens=(1, 5, 9, 14)) -> torch.Tensor:
    from tests.test_gguf_formats import our_logits

    return our_logits(model.config, model.params, list(tokens))


def test_hub_id_loads_what_the_local_directory_does_and_fetches_only_that(hub, repos):
    root, _ = repos
    ours = load_model("org/tiny", device="cpu", progress=False)
    local = load_model(root / "tiny" / "main", device="cpu", progress=False)
    assert ours.model_id == "org/tiny"
    assert torch.equal(first_logits(ours), first_logits(local))
    fetched = {path.rsplit("/", 1)[-1] for method, path in hub.requests if method == "GET" and "/resolve/" in path}
    assert fetched == {"config.json", "generation_config.json", "model.safetensors"}
    v1 = load_model("org/tiny@v1", device="cpu", progress=False)
    assert not torch.equal(first_logits(v1), first_logits(ours))
    assert torch.equal(first_logits(v1), first_logits(load_model(root / "tiny" / "v1", device="cpu",
                                                                 progress=False)))


def test_gguf_repository_needs_a_file_choice_when_it_has_several(hub, repos):
    root, _ = repos
    with pytest.raises(ModelFetchError, match=r"holds 2 GGUF files, pick one with --gguf-file .*'tiny-copy.gguf', "
                                              r"'tiny-f32.gguf'"):
        load_model("org/tiny-gguf", device="cpu", progress=False)
    ours = load_model("org/tiny-gguf", gguf_file="tiny-f32.gguf", device="cpu", progress=False)
    assert ours.tokenizer is not None and ours.model_id == "org/tiny-gguf"
    assert torch.equal(first_logits(ours), first_logits(load_model(root / "gguf" / "tiny-f32.gguf", device="cpu",
                                                                   progress=False)))
    assert not any("tiny-copy" in path for _, path in hub.requests if "/resolve/" in path)


def test_hub_errors_name_what_is_wrong(hub):
    with pytest.raises(ModelFetchError, match="org/nope: no such repository"):
        load_model("org/nope", device="cpu", progress=False)
    with pytest.raises(ModelFetchError, match="revision 'v9' does not exist"):
        load_model("org/tiny@v9", device="cpu", progress=False)
    with pytest.raises(ModelFetchError, match="it has no file 'missing.gguf'"):
        load_model("org/tiny-gguf", gguf_file="missing.gguf", device="cpu", progress=False)


def test_offline_mode_loads_from_the_cache_without_a_request(hub, monkeypatch):
    load_model("org/tiny", device="cpu", progress=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    served = len(hub.requests)
    assert load_model("org/tiny", device="cpu", progress=False).model_id == "org/tiny"
    assert len(hub.requests) == served
    with pytest.raises(ModelFetchError, match="not in the Hub cache"):
        load_model("org/tiny@v1", device="cpu", progress=False)


def test_private_repository_needs_hf_token(repos, tmp_path, monkeypatch):
    root, _ = repos
    with FakeHub({"org/private": {"main": root / "tiny" / "main"}}, token="hf_secret") as fake:
        point_hub_at(monkeypatch, fake.url, home=tmp_path / "hf_home")
        with pytest.raises(ModelFetchError, match="gated; accept its terms on the Hub and set HF_TOKEN"):
            load_model("org/private", device="cpu", progress=False)
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        assert load_model("org/private", device="cpu", progress=False).model_id == "org/private"


def test_cli_generates_from_a_hub_gguf_in_its_own_process(hub, tmp_path):
    """The whole path as a user runs it: HF_ENDPOINT read by huggingface_hub at import."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "cli_home"),
           "HF_HUB_CACHE": str(tmp_path / "cli_home" / "hub"), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_TOKEN", None)
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--model", "org/tiny-gguf",
                           "--gguf-file", "tiny-f32.gguf", "--device", "cpu", "--max-tokens", "4",
                           "--temperature", "0", "ab"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()  # (four tokens of a random model: some text)
    assert (tmp_path / "cli_home" / "hub" / "models--org--tiny-gguf").is_dir()
