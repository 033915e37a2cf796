"""What a user gets from the sdist: the whole tracked tree (MANIFEST.in), so that its tests run and the README's
commands find the files they name. (The wheel's packages: tests/test_public.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tree() -> list[str]:
    """The checkout's files git tracks or would (untracked ones it does not ignore), relative to ROOT."""
    found = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60) if shutil.which("git") else None
    if found is None or found.returncode != 0:
        pytest.skip("not a git checkout: which files belong to the tree is unknown")
    return sorted(name for name in found.stdout.split("\0") if name and (ROOT / name).is_file())


def test_the_sdist_holds_every_file_of_the_tree(tmp_path):
    pytest.importorskip("setuptools", reason="the build backend pyproject.toml names")
    tree = _tree()
    copy = tmp_path / "tree"
    for name in tree:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    dist = tmp_path / "dist"
    build = "import sys, setuptools.build_meta as b; b.build_sdist(sys.argv[1])"
    subprocess.run([sys.executable, "-c", build, str(dist)], cwd=copy, check=True, capture_output=True, timeout=300)
    (archive,) = dist.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        inside = {member.name.split("/", 1)[1] for member in tar.getmembers() if member.isfile()}
    assert [name for name in tree if name not in inside] == []
    assert {"tests/conftest.py", "examples/configs/deepseek-v3.2.json", "tox.ini"} <= inside
