"""Every test file under tests/ is run by some env of tox's env_list, read from tox.ini's pytest commands: a new
test file cannot fall between the environments. Tests are selected by folder: ``py`` runs everything but
tests/conformance and tests/kernels, ``kernels-interpret`` runs tests/kernels (whose conftest skips them all
without TRITON_INTERPRET=1), the backend envs run tests/conformance."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# Folders whose conftest skips every test unless a variable is set from process start: (name, value).
NEEDS_ENV = {"tests/kernels": ("TRITON_INTERPRET", "1")}


def _tox(text: str) -> configparser.ConfigParser:
    config = configparser.ConfigParser(interpolation=None)
    config.read_string(text)
    return config


def _value(config: configparser.ConfigParser, env: str, key: str) -> str:
    """An env's setting (else [testenv]'s), with tox's ``{[section]key}`` references expanded."""

    def expand(text: str) -> str:
        return re.sub(r"\{\[([^\]]+)\](\w+)\}", lambda m: expand(config.get(m[1], m[2], fallback="")), text)

    for section in (f"testenv:{env}", "testenv"):
        if config.has_option(section, key):
            return expand(config.get(section, key))
    return ""


def _set_env(config: configparser.ConfigParser, env: str) -> dict[str, str]:
    pairs = (line.partition("=") for line in _value(config, env, "set_env").splitlines() if "=" in line)
    return {name.strip(): value.strip() for name, _, value in pairs}


def _pytest_selections(config: configparser.ConfigParser, env: str, testpaths: list[str]):
    """(paths, ignored paths) of each pytest command of an env."""
    for line in _value(config, env, "commands").splitlines():
        words = shlex.split(line.replace("{posargs}", ""))
        if words[:1] != ["pytest"] and words[:3] != ["python", "-m", "pytest"]:
            continue
        words = words[words.index("pytest") + 1:]
        paths, ignored = [], []
        while words:
            word = words.pop(0)
            if word.startswith("--ignore="):
                ignored.append(word.partition("=")[2])
            elif word == "--ignore":
                ignored.append(words.pop(0))
            elif word in ("-q", "-x", "-v", "-rs"):
                continue
            elif word == "-k":  # a selection of tests inside the paths: the files are still run
                words.pop(0)
            else:
                assert not word.startswith("-"), f"tox env {env}: {word!r} is an option this test cannot read"
                paths.append(word)
        yield paths or testpaths, ignored


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def runners(tox_text: str, test_files: list[str], testpaths: list[str]) -> dict[str, list[str]]:
    """For each test file (a path relative to the repository), the envs of env_list that run it: select it and do not
    skip it for a variable they lack."""
    config = _tox(tox_text)
    envs = [e.strip() for e in config.get("tox", "env_list").split(",")]
    found: dict[str, list[str]] = {f: [] for f in test_files}
    for env in envs:
        set_env = _set_env(config, env)
        for paths, ignored in _pytest_selections(config, env, testpaths):
            for f in test_files:
                selected = any(_under(f, p) for p in paths) and not any(_under(f, i) for i in ignored)
                skipped = any(_under(f, folder) and set_env.get(name) != value
                              for folder, (name, value) in NEEDS_ENV.items())
                if selected and not skipped and env not in found[f]:
                    found[f].append(env)
    return found


def _testpaths() -> list[str]:
    match = re.search(r"^testpaths\s*=\s*\[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M)
    return re.findall(r'"([^"]+)"', match[1])


def _test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                  if p.name.startswith("test_") or p.name.endswith("_test.py"))


def test_every_test_file_is_run_by_an_env_of_the_env_list():
    found = runners((ROOT / "tox.ini").read_text(), _test_files(), _testpaths())
    orphans = [f for f, envs in found.items() if not envs]
    assert not orphans, f"no tox env of env_list runs {orphans} (tox.ini; tests/kernels needs TRITON_INTERPRET=1)"


def test_every_path_a_tox_command_names_exists():
    config = _tox((ROOT / "tox.ini").read_text())
    envs = [s.partition(":")[2] for s in config.sections() if s.startswith("testenv:")]
    for env in envs:
        for paths, ignored in _pytest_selections(config, env, _testpaths()):
            for p in paths + ignored:
                assert (ROOT / p.partition("::")[0]).exists(), f"tox env {env} names {p}, which does not exist"


def test_a_file_only_an_env_without_the_interpreter_selects_is_reported():
    """The defect of issue 35: a kernel test file that the unit env selects but skips, and the kernel env's list of
    files omits."""
    tox = """
[tox]
env_list = py, kernels-interpret
[testenv]
set_env =
    PYTHONUNBUFFERED = 1
[testenv:py]
commands = pytest -q --ignore=tests/conformance {posargs}
[testenv:kernels-interpret]
set_env =
    {[testenv]set_env}
    TRITON_INTERPRET = 1
commands =
    pytest -q tests/kernels/test_triton_topk.py {posargs}
    python ci/memcheck_translate.py
"""
    files = ["tests/kernels/test_triton_topk.py", "tests/kernels/test_triton_producer.py", "tests/test_plan.py",
             "tests/conformance/test_conformance.py"]
    assert runners(tox, files, ["tests"]) == {"tests/kernels/test_triton_topk.py": ["kernels-interpret"],
                                              "tests/kernels/test_triton_producer.py": [],
                                              "tests/test_plan.py": ["py"],
                                              "tests/conformance/test_conformance.py": []}


def test_envs_that_share_an_env_dir_run_one_after_another():
    """The CPU envs share installed envs (lanes) under tox -p: two envs of one env_dir must be ordered by depends
    (tox -p starts an env once the envs it depends on are done), or they would install into one folder at once."""
    config = _tox((ROOT / "tox.ini").read_text())
    envs = [e.strip() for e in config.get("tox", "env_list").split(",")]
    folder = {env: _value(config, env, "env_dir").replace("{env_name}", env) for env in envs}
    before = {env: {d.strip() for d in _value(config, env, "depends").split(",") if d.strip()} for env in envs}

    def after(env: str) -> set[str]:
        return before[env] | {e for d in before[env] for e in after(d)}

    lanes: dict[str, list[str]] = {}
    for env in envs:
        lanes.setdefault(folder[env], []).append(env)
    assert len(lanes) > 2, lanes  # the lanes and lint's own env
    for lane in lanes.values():
        for i, a in enumerate(lane):
            for b in lane[i + 1:]:
                assert a in after(b) or b in after(a), f"{a} and {b} share {folder[a]} but may run at once"


def test_a_backend_env_without_its_backend_stops_with_one_line():
    """issue 35 item 7: tox -e cuda on a machine without an NVIDIA GPU printed 91 tracebacks (1,474 lines); the
    conformance suite stops before any case with one line saying why and which env runs the kernels interpreted."""
    missing = "rocm" if torch.cuda.is_available() and not torch.version.hip else "cuda"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["INDEXCACHE_CONFORMANCE_BACKENDS"] = f"{missing},torch"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/conformance"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 4 and len(lines) == 1, done.stdout + done.stderr
    assert re.fullmatch(rf"ERROR: INDEXCACHE_CONFORMANCE_BACKENDS names {missing}, which cannot run here: .+ "
                        rf"\(tox -e {missing}-interpret does\)", lines[0]), lines[0]


def test_the_rocm_env_takes_torch_and_its_triton_from_pytorchs_rocm_index():
    """PyPI has no ROCm build of torch and no pytorch-triton-rocm past 2.1.0: ``tox -e rocm`` took its deps from
    PyPI (the cuda env's), a CUDA torch, so on an AMD GPU the rocm backend could not run. It now installs from the
    index the README and the rocm backend's install hint name (``--index-url``: with an extra index pip would take
    PyPI's newer CUDA build)."""
    from indexcache.backends.rocm.arch import AMD

    config = _tox((ROOT / "tox.ini").read_text())
    deps = [line.strip() for line in _value(config, "rocm", "deps").splitlines() if line.strip()]
    assert deps == [f"--index-url {{env:INDEXCACHE_TORCH_INDEX:{AMD.torch_index}}}",
                    "{env:INDEXCACHE_TORCH_SPEC:torch}", "{env:INDEXCACHE_TRITON_SPEC:pytorch-triton-rocm}"]
