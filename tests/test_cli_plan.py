"""``indexcache plan``: human and JSON output, overrides, and exit status 2 without a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from indexcache.plan import LayerPlan
from indexcache.plan.descriptor import Descriptor
from indexcache.tools.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "configs"
V32 = str(EXAMPLES / "deepseek-v3.2.json")
GLM = str(EXAMPLES / "glm-5.2.json")
V4 = str(EXAMPLES / "deepseek-v4-flash.json")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    return json.loads(out)


def test_json_has_exactly_the_documented_keys(capsys):
    data = run_json(capsys, "--config", V32)
    assert set(data) == {"roles", "producers", "shared", "sources", "signature"}
    assert data["roles"] == "FFSSS" + "FSSS" * 14
    assert data["producers"] == [0, 1, *range(5, 58, 4)]
    assert len(data["shared"]) == 45 and data["shared"][:3] == [2, 3, 4]
    assert data["sources"]["2"] == 1 and data["sources"]["60"] == 57
    assert set(data["sources"]) == {str(layer) for layer in data["shared"]}
    assert data["signature"] == Descriptor.from_plan(LayerPlan.from_config(V32)).signature


@pytest.mark.parametrize(
    ("config", "producers", "roles_start"), [(GLM, 21, "FFFSSSF"), (V4, 6, "..F.S.S.S.F")]
)
def test_json_for_each_example(capsys, config, producers, roles_start):
    data = run_json(capsys, "--config", config)
    assert len(data["producers"]) == producers
    assert data["roles"].startswith(roles_start)


def test_v4_sources_point_at_the_c4_producer(capsys):
    data = run_json(capsys, "--config", V4)
    assert data["producers"] == [2, 10, 18, 26, 34, 42]
    assert data["sources"]["4"] == 2 and data["sources"]["40"] == 34
    assert "3" not in data["sources"]


def test_human_form(capsys):
    code, out, err = run(capsys, "--config", V32)
    assert (code, err) == (0, "")
    assert "FFSSS" + "FSSS" * 14 in out
    assert "61 sparse: 16 producers, 45 shared" in out
    assert "producers: 0, 1, 5, 9, 13," in out
    assert Descriptor.from_plan(LayerPlan.from_config(V32)).signature in out


def test_freq_and_offset_override_the_config(capsys):
    data = run_json(capsys, "--config", GLM, "--freq", "2")
    assert data["producers"][:4] == [0, 1, 2, 4]
    data = run_json(capsys, "--config", GLM, "--offset", "2")
    assert len(data["producers"]) == 21 and data["producers"][:3] == [0, 1, 5]
    data = run_json(capsys, "--config", V32, "--freq", "1")
    assert data["shared"] == [] and data["sources"] == {}


def test_pattern_override_and_unchanged_signature(capsys):
    base = run_json(capsys, "--config", V4)
    data = run_json(capsys, "--config", V4, "--pattern", "F" + "S" * 20)
    assert data["producers"] == [2]
    assert data["signature"] == base["signature"]


def test_page_size_changes_the_signature(capsys):
    base = run_json(capsys, "--config", V32)
    data = run_json(capsys, "--config", V32, "--page-size", "1")
    assert data["signature"] != base["signature"] and data["roles"] == base["roles"]


def test_without_page_size_the_configs_own_is_used(capsys, tmp_path):
    """``--page-size`` defaults to the config's ``page_size`` (as its help says), 64 only where the config has none."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads(Path(V32).read_text()), "page_size": 128}))
    own = run_json(capsys, "--config", str(config))["signature"]
    assert own == run_json(capsys, "--config", str(config), "--page-size", "128")["signature"]
    assert own != run_json(capsys, "--config", str(config), "--page-size", "64")["signature"]
    assert run_json(capsys, "--config", V32)["signature"] == run_json(capsys, "--config", V32, "--page-size",
                                                                      "64")["signature"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", V32, "--pattern", "FSX"], "index_topk_pattern='FSX': position 2 is 'X'"),
        (
            ["--config", V32, "--pattern", "SFF"],
            "index_topk_pattern='SFF': has 3 entries, not the layer count (61)",
        ),
        (["--config", V4, "--pattern", "S" + "F" * 20], "the first sparse layer (layer 2) is 'S'"),
        (["--config", V32, "--pattern", "FS", "--freq", "2"], "give --pattern or --freq/--offset, not both"),
        (["--config", "/nonexistent/config.json"], "cannot read --config /nonexistent/config.json"),
        (["--config", str(EXAMPLES)], "cannot read --config"),
    ],
)
def test_invalid_input_exits_2_with_the_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("indexcache plan: error: ")
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"index_topk_freq": 4}', "config has no layer count"),
        ('{"num_hidden_layers": 4, "index_topk_freq": 2.5}', "index_topk_freq=2.5"),
        ('{"num_hidden_layers": 4, "indexer_types": ["full", "half"]}', "indexer_types=['full', 'half']"),
    ],
)
def test_invalid_config_exits_2(capsys, tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    code, out, err = run(capsys, "--config", str(path))
    assert (code, out) == (2, "")
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--freq", "2.5"], "argument --freq: expected an integer in 1..4096, got '2.5'"),
        (["--freq", "0"], "argument --freq: expected an integer in 1..4096, got 0"),
        (["--freq", "5000"], "argument --freq: expected an integer in 1..4096, got 5000"),
        (["--offset", "0"], "argument --offset: expected an integer in 1..4096, got 0"),
        (["--page-size", "0"], "argument --page-size: expected an integer >= 1, got 0"),
    ],
)
def test_an_integer_flag_out_of_range_is_a_usage_error_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--config", V32, *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _console_script() -> str:
    beside = Path(sys.executable).with_name("indexcache")
    found = str(beside) if beside.exists() else shutil.which("indexcache")
    assert found, "the indexcache console script is not installed"
    return found


def test_console_script_on_an_example_config():
    result = subprocess.run(
        [_console_script(), "plan", "--config", V4, "--json"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["producers"] == [2, 10, 18, 26, 34, 42]
