"""The package as a user installs it: a wheel holds every file the code reads at run time.

CI installs editable (`pip install -e`), which reads the checkout; an index install reads only
what the wheel carries. Here the wheel is built from the tracked files alone, installed into a
folder of its own, and the files read at run time are read from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nanoinfer", "runtime")


def _tracked(*paths: str) -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout: the wheel is built from the tracked files")
    listed = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split("\0")
    return [name for name in listed if name and (ROOT / name).exists()]  # (not one deleted in the work tree)


class Built(NamedTuple):
    wheel: Path
    source: Path  # the copy of the tracked files it was built from


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """A wheel built from a copy of the tracked files (nothing the checkout has beside them),
    with the installed build backend: no index is asked, and nothing is written to the checkout."""
    pytest.importorskip("hatchling", reason="the build backend (pip install -e '.[test]' installs it)")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in _tracked("."):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = out.glob("nanoinfer-*.whl")
    return Built(wheel, src)


@pytest.fixture(scope="module")
def wheel(built) -> Path:
    return built.wheel


def test_building_the_wheel_writes_nothing_into_the_source_tree(built):
    """`pip install .` from a checkout leaves it as it was (no build/, no *.egg-info)."""
    assert sorted(p.name for p in built.source.iterdir()) == sorted({n.split("/")[0] for n in _tracked(".")})


def test_wheel_holds_every_file_of_the_packages(wheel):
    """Every tracked file under the packages (sources, the C kernels and their headers, tuned
    tables, the chat page) is in the wheel: whatever the code reads beside itself, it finds."""
    with zipfile.ZipFile(wheel) as whl:
        shipped = set(whl.namelist())
    missing = [f for f in _tracked(*PACKAGES) if f not in shipped]
    assert not missing, f"files of the packages that the wheel lacks: {missing}"
    assert not [f for f in shipped if f.startswith(("tests/", "bench/", "tools/"))]


@pytest.mark.slow
def test_installed_wheel_builds_its_cpu_kernels(wheel, tmp_path):
    """From a wheel installed apart from the checkout, the CPU kernels compile from the files
    the wheel installed (the C source and both headers) and the tuned tables are found."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                    "--target", str(site), str(wheel)], check=True, capture_output=True, text=True)
    script = (
        "import sys, nanoinfer, nanoinfer.backends.cpu.cpu_native as n, nanoinfer.backends.cuda.tuned_configs as t\n"
        f"assert nanoinfer.__file__.startswith({str(site)!r}), nanoinfer.__file__\n"
        f"lib = n.load(cache=__import__('pathlib').Path({str(tmp_path / 'native')!r}))\n"
        "assert lib is not None, 'the CPU kernels did not build'\n"
        "print(lib.block_dot_name().decode(), len(list(t.TUNED_DIR.glob('*.json'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    isa, tables = done.stdout.split()
    assert isa and int(tables) >= 1
