"""The README against the repository (issue 35 item 7): its ``indexcache`` commands parse, its quick start installs
what its later commands need, it names the Triton that tox installs, and the example configs cite only files that
are in the repository."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from indexcache.tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _shell_lines() -> list[str]:
    """The commands of the README's bash blocks, one a line, comments dropped, ``&&`` chains split."""
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    lines = [line.split(" # ")[0].strip() for block in blocks for line in block.splitlines()]
    return [part.strip() for line in lines for part in line.split("&&") if part.strip()]


def _extras() -> dict[str, list[str]]:
    """pyproject.toml's optional dependencies: extra -> requirements."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]")[1].split("\n[")[0]
    return {m[1]: re.findall(r'"([^"]+)"', m[2]) for m in re.finditer(r"^(\w+) = \[(.*)\]$", section, re.M)}


@pytest.mark.parametrize("command", [c for c in _shell_lines() if c.startswith("indexcache ")])
def test_every_indexcache_command_of_the_readme_parses(command):
    try:
        build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit as exc:
        pytest.fail(f"the README's `{command}` does not parse (exit {exc.code})")


def test_the_quick_start_installs_what_the_readme_commands_need():
    """`calibrate ... --out` draws plots and `demo --plot` writes one: both need matplotlib (the bench extra),
    which the quick start installed not (they failed right after it); the kernels need Triton (cuda)."""
    (install,) = [c for c in _shell_lines() if c.startswith('pip install -e ".[')]
    wanted = re.search(r"\[([\w,]+)\]", install)[1].split(",")
    extras = _extras()
    deps = [dep for extra in wanted for dep in extras[extra]]
    assert any(dep.startswith("matplotlib") for dep in deps), install
    assert any(dep.startswith("triton") for dep in deps), install
    assert any(c.startswith("indexcache demo --plot") for c in _shell_lines())


def test_the_readme_names_the_triton_and_torch_that_tox_installs():
    tox = (ROOT / "tox.ini").read_text()
    triton = re.search(r"\{env:INDEXCACHE_TRITON_SPEC:triton==([\d.]+)\}", tox)[1]
    torch = re.search(r"\{env:INDEXCACHE_TORCH_SPEC:torch==([\d.]+)\}", tox)[1]
    index = re.search(r"\{env:INDEXCACHE_TORCH_INDEX:(\S+)\}", tox)[1]
    named = re.findall(r"CI (?:tests|compiles with) Triton ([\d.]+)", README)
    assert named and set(named) == {triton}, named
    assert f"pip install torch=={torch} --index-url {index}" in _shell_lines()


def test_the_example_configs_cite_only_files_in_the_repository():
    """Every Markdown file an example config's comment names lies in this repository."""
    for path in sorted((ROOT / "examples" / "configs").glob("*.json")):
        comment = json.loads(path.read_text()).get("_comment", "")
        for name in re.findall(r"[\w./-]+\.md\b", comment):
            assert (ROOT / name).exists(), f"{path.name} cites {name}, which is not in the repository"


def test_the_compile_check_paragraph_names_every_kernel_allowed_more():
    """Every kernel whose compile check allows a stack frame or more AMD SGPR spills than the default says so in a
    module constant (``*STACK_BYTES``, ``*SGPR_SPILLS``); the README's compile-check rules name each one, so that
    they do not say one kernel alone may keep a stack frame while others may too."""
    triton = ROOT / "backends" / "triton"
    allowances = [
        f"{'.'.join(path.relative_to(triton).with_suffix('').parts)}.{name}"
        for path in sorted(triton.rglob("*.py")) if path.name != "crosscompile.py"  # its MAX_SGPR_SPILLS: the default
        for name in re.findall(r"^([A-Z0-9_]*(?:STACK_BYTES|SGPR_SPILLS)) *=", path.read_text(), re.M)]
    assert len(allowances) >= 4, allowances
    paragraph = README.split("**Cross-compiled kernel reports.**")[1].split("\n\n")[0]
    missing = [name for name in allowances if f"`{name}`" not in paragraph]
    assert not missing, f"the README's compile-check rules do not name {missing}"


def test_the_pd_recipe_of_the_readme_runs():
    """The README's "Pipeline stages and P/D": boundaries after layer 0, descriptors read back from their JSON (the
    payload itself is refused), and the promoted plan of the stages compatible with itself, not with the plain one."""
    import functools

    from indexcache.plan import LayerPlan
    from indexcache.plan.descriptor import Descriptor, PDIncompatibleError, check_pd_compatible

    assert "`[30]` splits a 61-layer plan in two" in README
    plan = LayerPlan.from_config(ROOT / "examples" / "configs" / "deepseek-v3.2.json")
    stages = plan.split_stages([30], mode="promote")
    assert [(s.start, s.stop, s.promoted) for s in stages] == [(0, 30, ()), (30, 61, (30,))]
    staged = functools.reduce(LayerPlan.for_stage, stages, plan)
    payload = Descriptor.from_plan(staged).to_json()
    check_pd_compatible(Descriptor.from_json(payload), Descriptor.from_json(payload))
    with pytest.raises(TypeError, match=r"prefill: expected a Descriptor .*got str"):
        check_pd_compatible(payload, payload)
    with pytest.raises(PDIncompatibleError):
        check_pd_compatible(Descriptor.from_plan(plan), Descriptor.from_plan(staged))


def test_every_torch_the_readme_installs_is_new_enough():
    """A bare ``pip install torch --index-url ...`` takes the newest torch of that index, however old: the next
    ``pip install -e .`` then replaced it with PyPI's torch (a CUDA build). Each names a version it needs."""
    specifiers = pytest.importorskip("packaging.specifiers", reason="PEP 440 comparison")
    installs = [shlex.split(c) for c in _shell_lines() if c.startswith("pip install") and "--index-url" in c]
    torches = [word for words in installs for word in words if re.match(r"torch\b", word)]
    assert torches, installs
    for word in torches:
        spec = specifiers.SpecifierSet(word.removeprefix("torch"))
        assert "2.10.0" not in spec and ("2.11.0" in spec or "2.13.0" in spec), f"the README installs {word!r}"
