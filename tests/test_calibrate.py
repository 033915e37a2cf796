"""Pattern calibration: overlap matrix against brute force, dump loading, greedy-search rules, planted
layer groups, objective caching, the index_topk_freq baselines, dumps from the small model, and the
``indexcache calibrate`` command end to end."""

from __future__ import annotations

import json
import math
import re
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexcache.plan import ConfigError, LayerPlan
from indexcache.tools import calibrate
from indexcache.tools.calibrate.dump import load_dump
from indexcache.tools.calibrate.freq_rule import freq_baselines
from indexcache.tools.calibrate.objective import CachedObjective, overlap_objective
from indexcache.tools.calibrate.overlap import overlap_matrix
from indexcache.tools.calibrate.pattern import check_pattern, producer_budget, uniform_pattern
from indexcache.tools.calibrate.search import greedy_search
from indexcache.tools.cli import main
from indexcache.tools.model.calibration import record_dump
from indexcache.tools.model.config import ModelSettingError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"
# The small model at test sizes: 2 prompts x 160 tokens, k 32, so 2 x 128 rows with more context than k.
MODEL_SIZES = {"prompt_len": 160, "topk": 32}


@pytest.fixture(scope="module")
def v32_dump():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield record_dump("v32-like", **MODEL_SIZES)
    finally:
        torch.set_num_threads(threads)


def c4_layers(compress_ratios: list[int]) -> list[int]:
    """The sparse layers of a DeepSeek-V4 style model: those whose compression ratio is 4 (C4)."""
    return [layer for layer, ratio in enumerate(compress_ratios) if ratio == 4]


def brute_overlap(stack: np.ndarray) -> np.ndarray:
    """Python sets, row by row: mean over rows with any index of |T_i & T_j| / (largest row fill)."""
    layers, rows, _ = stack.shape
    total, counted = np.zeros((layers, layers)), 0
    for r in range(rows):
        sets = [{int(x) for x in stack[layer, r] if x >= 0} for layer in range(layers)]
        fill = max(len(s) for s in sets)
        if fill == 0:
            continue
        counted += 1
        for i in range(layers):
            for j in range(layers):
                total[i, j] += len(sets[i] & sets[j]) / fill
    return total / counted


def planted_stack(group_sizes: list[int], seed: int, rows: int = 24, k: int = 16, span: int = 5000) -> np.ndarray:
    """Layers in a group keep ~90 % of their group's per-row base set; groups draw independent bases."""
    rng = np.random.default_rng(seed)
    layers = []
    for size in group_sizes:
        base = np.stack([rng.choice(span, k, replace=False) for _ in range(rows)])
        for _ in range(size):
            layer = base.copy()
            fresh = rng.random((rows, k)) < 0.1
            layer[fresh] = rng.integers(0, span, int(fresh.sum()))
            layers.append(layer)
    return np.stack(layers).astype(np.int32)


def leaders_pattern(group_sizes: list[int]) -> str:
    return "".join("F" + "S" * (size - 1) for size in group_sizes)


# ----------------------------------------------------------------------------------------------- overlap


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 5),
    rows=st.integers(1, 20),
    k=st.integers(1, 12),
    span=st.sampled_from([1, 3, 40, 300_000]),
    empty=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
    threads=st.integers(1, 2),
)
def test_overlap_matches_brute_force(layers, rows, k, span, empty, seed, threads):
    rng = np.random.default_rng(seed)
    stack = rng.integers(0, span, (layers, rows, k)).astype(np.int32)
    stack[rng.random(stack.shape) < empty] = -1
    if not (stack >= 0).any():
        stack[0, 0, 0] = 0
    got = overlap_matrix(list(stack), threads=threads)
    np.testing.assert_allclose(got, brute_overlap(stack), rtol=0, atol=1e-12)


@pytest.mark.parametrize("top", [5000, 2**31 - 1, 2**62])
def test_renumbered_rows_give_the_table_path_overlap(monkeypatch, top):
    """Rows renumbered densely (indices far beyond layers x k) give the plain table's overlap, over many blocks."""
    rng = np.random.default_rng(7)
    small = np.where(rng.random((4, 300, 8)) < 0.1, -1, rng.integers(0, 200, (4, 300, 8)))
    large = np.where(small >= 0, top - small, -1)  # the same sets under other names
    monkeypatch.setattr("indexcache.tools.calibrate.overlap._COMPACT_FACTOR", 10**9)
    plain = overlap_matrix(list(small), threads=2)
    monkeypatch.setattr("indexcache.tools.calibrate.overlap._COMPACT_FACTOR", 0)
    np.testing.assert_allclose(overlap_matrix(list(large), threads=2), plain, rtol=0, atol=1e-12)
    np.testing.assert_allclose(plain, brute_overlap(small), rtol=0, atol=1e-12)


def test_overlap_accepts_torch_int64_and_flattens_leading_dims():
    rng = np.random.default_rng(0)
    stack = rng.integers(-1, 30, (3, 4, 5, 6)).astype(np.int64)  # layer, batch, token, k
    tensors = [torch.from_numpy(layer) for layer in stack]
    np.testing.assert_allclose(overlap_matrix(tensors), brute_overlap(stack.reshape(3, 20, 6)), atol=1e-12)


def test_overlap_identical_disjoint_and_short_rows():
    same = np.array([[0, 5, 9, -1], [1, 2, -1, -1]], np.int32)  # short rows: overlap is still 1
    disjoint = np.array([[1, 2, 3, -1], [3, 4, -1, -1]], np.int32)
    got = overlap_matrix([same, same.copy(), disjoint])
    np.testing.assert_allclose(got[:2, :2], 1.0)
    np.testing.assert_allclose(got[0, 2], 0.0)
    np.testing.assert_allclose(got, got.T)


@pytest.mark.parametrize(
    "arrays, message",
    [
        ([], "no layers"),
        ([np.array([[0, -2]])], "-2"),
        ([np.full((2, 3), -1)], "every slot"),
        ([np.zeros((2, 3), np.int32), np.zeros((3, 3), np.int32)], "shape"),
        ([np.zeros((2, 3), np.float32)], "integers"),
        ([np.zeros(3, np.int32)], r"\[rows, k\]"),
    ],
)
def test_overlap_rejects_bad_input(arrays, message):
    with pytest.raises(ValueError, match=message):
        overlap_matrix(arrays)


@pytest.mark.parametrize("threads", [0, -2, 1.5, "2", True])
def test_overlap_refuses_a_thread_count_that_is_not_one_or_more(threads, tmp_path):
    """``threads`` (calibrate_dump's and calibrate_arrays' too) is a count >= 1: 0 and -2 ran on one thread without a
    word, "2" and 1.5 failed inside the thread pool with a TypeError naming no argument."""
    arrays = [np.array([[0, 1]], np.int32)] * 2
    with pytest.raises(calibrate.CalibrationError, match=rf"^threads={threads!r}: must be an integer >= 1"):
        overlap_matrix(arrays, threads=threads)
    with pytest.raises(calibrate.CalibrationError, match=rf"^threads={threads!r}: must be an integer >= 1"):
        calibrate.calibrate_arrays([0, 1], arrays, tmp_path / "out", threads=threads, plots=False)
    assert not (tmp_path / "out").exists()
    assert overlap_matrix(arrays, threads=None)[0, 1] == overlap_matrix(arrays, threads=3)[0, 1] == 1.0


# ----------------------------------------------------------------------------------------------- loading


def test_load_dump_reads_pt_and_npz_by_layer_id(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {layer: rng.integers(-1, 50, (6, 4)).astype(np.int32) for layer in (2, 4, 10)}
    torch.save(torch.from_numpy(arrays[2]), tmp_path / "layer_002.pt")
    np.savez(tmp_path / "layer_4.npz", arrays[4])
    np.savez(tmp_path / "layer_10.npz", indices=arrays[10], lengths=np.arange(6))
    (tmp_path / "notes.txt").write_text("ignored")
    torch.save(torch.zeros(1), tmp_path / "layer_x.pt")  # not a layer file name: ignored
    layers, loaded = load_dump(tmp_path)
    assert layers == [2, 4, 10]
    for layer, array in zip(layers, loaded, strict=True):
        np.testing.assert_array_equal(array, arrays[layer])


def test_load_dump_reads_only_names_of_ascii_digits(tmp_path):
    """``layer_<id>`` is ASCII digits and the whole name: a fullwidth or Arabic-Indic digit (which int() reads) and a
    name ending in a newline (which ``$`` let through) were read as layers 3, 1 and 2; they are other files."""
    for name in ("layer_0.pt", "layer_\uff13.pt", "layer_\u0661.npz", "layer_2.pt\n"):
        torch.save(torch.zeros(2, 3, dtype=torch.int32), tmp_path / name)
    layers, arrays = load_dump(tmp_path)
    assert layers == [0] and len(arrays) == 1


def test_load_dump_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_dump(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no layer_"):
        load_dump(tmp_path)
    (tmp_path / "file.npz").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match=r"file\.npz: not a directory; expected the dump directory"):
        load_dump(tmp_path / "file.npz")
    (tmp_path / "file.npz").unlink()
    (tmp_path / "layer_0.npz").symlink_to(tmp_path / "nowhere.npz")
    with pytest.raises(calibrate.DumpError, match=r"layer_0\.npz: cannot be read \(No such file or directory\)"):
        load_dump(tmp_path)
    (tmp_path / "layer_0.npz").unlink()
    torch.save(torch.zeros(2, 3, dtype=torch.int32), tmp_path / "layer_1.pt")
    np.savez(tmp_path / "layer_001.npz", np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="layer 1 appears twice"):
        load_dump(tmp_path)
    (tmp_path / "layer_001.npz").unlink()
    np.savez(tmp_path / "layer_2.npz", a=np.zeros((2, 3), np.int32), b=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="'indices'"):
        load_dump(tmp_path)
    np.savez(tmp_path / "layer_2.npz", np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="layer_2.npz: shape"):
        load_dump(tmp_path)
    torch.save({"indices": torch.zeros(2, 3)}, tmp_path / "layer_2.pt")
    (tmp_path / "layer_2.npz").unlink()
    with pytest.raises(ValueError, match="holds a dict"):
        load_dump(tmp_path)


@pytest.mark.parametrize(("value", "message"), [
    (torch.tensor([[1, 2], [3, 4]]).to_sparse(), "a sparse_coo tensor; top-k indices must be a dense integer"),
    (torch.empty(2, 2, dtype=torch.int32, device="meta"), "a meta tensor"),
    (torch.ones(2, 2, dtype=torch.bfloat16), "dtype torch.bfloat16; top-k indices must be integers"),
    (torch.ones(2, 2).to(torch.float8_e4m3fn), "dtype torch.float8_e4m3fn; top-k indices must be integers"),
])
def test_a_dump_tensor_that_is_not_dense_integers_is_a_dump_error(tmp_path, value, message):
    """Tensors numpy cannot take (sparse, meta, bf16, fp8) are a DumpError naming the file, not numpy's or torch's
    TypeError / RuntimeError from the conversion."""
    torch.save(value, tmp_path / "layer_0.pt")
    with pytest.raises(calibrate.DumpError, match=f"layer_0.pt: {message}"):
        load_dump(tmp_path)


# ------------------------------------------------------------------------------------------------ search


def test_producer_budget():
    assert producer_budget(61, keep=0.25) == 16  # as index_topk_freq=4 on DeepSeek-V3.2
    assert producer_budget(21, keep=0.25) == 6  # as freq 4 on V4-Flash's 21 C4 layers
    assert producer_budget(30, keep=0.1) == 3  # no float round-up to 4
    assert producer_budget(5, keep=0.01) == 1
    assert producer_budget(5, keep=1.0) == 5
    assert producer_budget(5, producers=2) == 2
    # A numpy integer is a count, as it is a layer id (it was refused as "producers=np.int64(2): must be an integer").
    assert type(producer_budget(5, producers=np.int64(2))) is int and producer_budget(5, producers=np.uint8(5)) == 5
    assert greedy_search(np.arange(4), lambda p: p.count("S"), producers=np.int64(2)).pattern == "FSSF"
    assert producer_budget(61, keep=np.float32(0.25)) == 16  # np.float32 is no float subclass: it was refused


def test_calibrate_arrays_takes_numpy_numbers_for_keep_and_producers(tmp_path):
    stack = planted_stack([2, 2], seed=1)
    found = calibrate.calibrate_arrays(np.arange(4), list(stack), tmp_path, keep=np.float32(0.5), plots=False)
    assert found.search.producers == [0, 2]
    assert json.loads(found.paths["report.json"].read_text())["keep"] == 0.5
    found = calibrate.calibrate_arrays(np.arange(4), list(stack), tmp_path, producers=np.int64(2), plots=False)
    assert found.search.producers == [0, 2]
    for kwargs in (
        {},
        {"keep": 0.5, "producers": 2},
        {"keep": 0.0},
        {"keep": 1.5},
        {"keep": True},
        {"producers": 0},
        {"producers": 6},
        {"producers": 2.0},
    ):
        with pytest.raises(ValueError):
            producer_budget(5, **kwargs)


def test_uniform_pattern():
    assert uniform_pattern(8, 2) == "FSSSFSSS"
    assert uniform_pattern(5, 5) == "FFFFF"
    assert uniform_pattern(61, 16).count("F") == 16


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ratios=st.lists(st.sampled_from([0, 4, 128]), min_size=1, max_size=24).filter(lambda r: 4 in r),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
    use_proxy=st.booleans(),
)
def test_search_respects_the_rules(ratios, data, seed, use_proxy):
    layers = c4_layers(ratios)
    num = len(layers)
    budget = data.draw(st.integers(1, num), label="producers")
    rng = np.random.default_rng(seed)
    if use_proxy:
        matrix = rng.random((num, num))
        objective = overlap_objective((matrix + matrix.T) / 2)
    else:
        values: dict[str, float] = {}

        def objective(pattern: str) -> float:
            check_pattern(pattern, num)  # the callback only ever sees valid patterns
            return values.setdefault(pattern, float(rng.integers(0, 4)))  # ties on purpose

    result = greedy_search(layers, objective, producers=budget)
    pattern = result.pattern
    assert len(pattern) == num and set(pattern) <= {"F", "S"}
    assert pattern[0] == "F" and pattern.count("F") == budget
    assert [step.producers for step in result.steps] == list(range(num, budget - 1, -1))
    assert result.steps[0].pattern == "F" * num and result.steps[0].flipped is None
    for before, step in zip(result.steps, result.steps[1:], strict=False):
        changed = [i for i in range(num) if before.pattern[i] != step.pattern[i]]
        assert len(changed) == 1 and changed[0] > 0
        assert before.pattern[changed[0]] == "F" and step.pattern[changed[0]] == "S"
        assert step.flipped == layers[changed[0]]
        alternatives = [
            objective(before.pattern[:i] + "S" + before.pattern[i + 1 :])
            for i in range(1, num)
            if before.pattern[i] == "F"
        ]
        assert step.objective == objective(step.pattern) == min(alternatives)
    roles = result.roles(len(ratios))
    assert [role is None for role in roles] == [ratio != 4 for ratio in ratios]
    assert [role for role in roles if role is not None] == list(pattern)
    plan = LayerPlan(len(ratios), compress_ratios=ratios, index_topk_pattern=pattern)
    assert plan.producers == result.producers


@settings(max_examples=25, deadline=None)
@given(group_sizes=st.lists(st.integers(1, 5), min_size=2, max_size=6), seed=st.integers(0, 2**32 - 1))
def test_search_finds_planted_group_leaders(group_sizes, seed):
    stack = planted_stack(group_sizes, seed)
    layers = list(range(len(stack)))
    result = greedy_search(layers, overlap_objective(overlap_matrix(list(stack))), producers=len(group_sizes))
    assert result.pattern == leaders_pattern(group_sizes)
    if result.pattern != uniform_pattern(len(layers), len(group_sizes)):
        assert result.steps[-1].objective < result.steps[-1].uniform_objective


def test_callback_objective_is_cached():
    stack = planted_stack([3, 4, 2, 3], seed=7)
    num, proxy = len(stack), overlap_objective(overlap_matrix(list(stack)))
    seen: list[str] = []

    def lm_loss(pattern: str) -> float:
        seen.append(pattern)
        return proxy(pattern)

    greedy = 1 + sum(range(4, num))  # all-F, then one candidate per flippable producer per step
    result = greedy_search(range(num), lm_loss, producers=4)
    assert len(seen) == len(set(seen))
    assert greedy <= len(seen) <= greedy + (num - 4)  # plus the evenly spaced baselines not met already

    seen.clear()
    cached = CachedObjective(lm_loss)
    first = greedy_search(range(num), cached, producers=4)
    assert cached.calls == len(seen) == len(cached.cache)
    assert first.pattern == result.pattern == leaders_pattern([3, 4, 2, 3])
    assert first.objective_name == "lm_loss"
    again = greedy_search(range(num), cached, producers=4)
    assert again == first and cached.calls == len(seen)
    calls = cached.calls
    deeper = greedy_search(range(num), cached, producers=2)
    assert deeper.steps[: len(first.steps)] == first.steps
    assert 3 + 2 <= cached.calls - calls <= 3 + 2 + 2  # only the two new steps' candidates and baselines
    assert len(seen) == len(set(seen)) == cached.calls


def test_greedy_search_is_a_name_of_the_calibrate_package():
    """The README's "From Python" names: ``calibrate.greedy_search(layers, objective, producers=...)`` and
    ``calibrate.calibrate_dump`` on ``from indexcache.tools import calibrate`` (the package split left the search
    importable from ``calibrate.search`` only: AttributeError)."""
    assert calibrate.greedy_search is greedy_search and "greedy_search" in calibrate.__all__
    result = calibrate.greedy_search([0, 1, 2, 3], lambda pattern: pattern.count("S") * 0.1, producers=2)
    assert result.pattern == "FSSF"  # equal losses: the earliest flippable layer first
    assert callable(calibrate.calibrate_dump)


def test_search_rejects_bad_input():
    with pytest.raises(ValueError, match="ascending"):
        greedy_search([3, 1], lambda p: 0.0, producers=1)
    for layers in ([0, 1.5, 3], ["0", "1"], [0, True]):  # int() would take them as 1 or 0
        with pytest.raises(ValueError, match=r"must be distinct, ascending, non-negative integer layer ids"):
            greedy_search(layers, lambda p: 0.0, producers=1)
    assert greedy_search(np.arange(3), lambda p: 0.0, producers=1).layers == (0, 1, 2)
    with pytest.raises(ValueError, match="producers"):
        greedy_search([0, 1], lambda p: 0.0, producers=3)
    with pytest.raises(ValueError, match="finite"):
        greedy_search([0, 1, 2], lambda p: math.nan, producers=1)
    # An objective that forgot its return (float() said "argument must be a string or a real number, not 'NoneType'").
    for returned in (None, "low", [0.5]):
        message = rf"^objective\('FFF'\) returned {re.escape(repr(returned))}; it must return a finite number"
        with pytest.raises(TypeError, match=message):
            greedy_search([0, 1, 2], lambda p, returned=returned: returned, producers=1)
    with pytest.raises(ValueError, match="first sparse layer"):
        overlap_objective(np.eye(2))("SF")


def test_freq_baselines_follow_the_plan():
    ratios = [0, 0] + [4, 128] * 9  # DeepSeek-V4 style: the freq rule counts C4 layers only
    layers = c4_layers(ratios)
    plan_for = partial(LayerPlan, len(ratios), compress_ratios=ratios)
    seen: list[str] = []

    def objective(pattern: str) -> float:
        seen.append(pattern)
        return pattern.count("S") / len(pattern)

    baselines = freq_baselines(layers, objective, plan_for, min_producers=2)
    assert [(b.freq, b.producers) for b in baselines] == [(2, 5), (3, 3), (5, 2)]  # freq 4 also keeps 3
    for baseline in baselines:
        plan = plan_for(index_topk_freq=baseline.freq)
        assert [layer for layer, role in zip(layers, baseline.pattern, strict=True) if role == "F"] == plan.producers
        assert baseline.objective == objective(baseline.pattern)
    assert set(seen) == {b.pattern for b in baselines}
    v32 = freq_baselines(range(12), objective, partial(LayerPlan, 12))
    assert next(b for b in v32 if b.freq == 4).pattern == "FFSSSFSSSFSS"  # skip(l) = max(l - 1, 0) % 4 != 0
    with pytest.raises(ValueError, match="sparse layers"):
        freq_baselines(layers, objective, partial(LayerPlan, len(ratios)))


# ----------------------------------------------------------------------------------------- the small model


def test_model_dump_rows_are_full_and_show_the_blocks(v32_dump):
    layers, arrays = v32_dump
    assert layers == list(range(12))
    for array in arrays:
        assert array.shape == (2 * (160 - 32), 32) and array.dtype == np.int32
        assert (array >= 0).all()  # rows with context <= k (which select everything) are dropped
        assert all(len(set(row)) == 32 for row in array[:20].tolist())
    overlap = overlap_matrix(arrays)
    adjacent = np.diag(overlap, 1)
    inside = [adjacent[i] for i in range(11) if (i + 1) % 4]  # the preset's indexers come in blocks of 4
    across = [adjacent[i] for i in (3, 7)]
    assert min(inside) > 0.7 and max(across) < 0.6
    assert max(inside) < 0.999  # every layer recorded its own top-k, not a reused one


def test_search_beats_the_freq_rule_on_the_small_model(v32_dump):
    layers, arrays = v32_dump
    objective = overlap_objective(overlap_matrix(arrays))
    rule = LayerPlan(len(layers), index_topk_freq=4)
    freq4 = "".join(rule.role(layer) for layer in layers)
    assert rule.producers == [0, 1, 5, 9]
    result = greedy_search(layers, objective, producers=len(rule.producers))
    assert result.steps[-1].objective < objective(freq4) - 0.02
    assert result.steps[-1].objective <= result.steps[-1].uniform_objective
    assert result.pattern != freq4


def test_record_dump_rejects_bad_sizes():
    with pytest.raises(ModelSettingError, match="must exceed topk"):
        record_dump("v32-like", prompt_len=32, topk=32)
    with pytest.raises(ModelSettingError, match="batch"):
        record_dump("v32-like", batch=0)
    with pytest.raises(ModelSettingError, match="preset"):
        record_dump("v5-like")


# ---------------------------------------------------------------------------------------------------- CLI


def write_dump(directory: Path, stack: np.ndarray, layers: list[int]) -> None:
    directory.mkdir()
    for layer, array in zip(layers, stack, strict=True):
        if layer % 2:
            torch.save(torch.from_numpy(array), directory / f"layer_{layer:03d}.pt")
        else:
            np.savez(directory / f"layer_{layer:03d}.npz", indices=array)


def test_cli_calibrate_end_to_end(tmp_path, capsys):
    groups = [3, 1, 4]
    stack = planted_stack(groups, seed=3)
    write_dump(tmp_path / "dump", stack, list(range(len(stack))))
    out = tmp_path / "out"
    assert main(["calibrate", "--dump", str(tmp_path / "dump"), "--producers", "3", "--out", str(out)]) == 0
    pattern = leaders_pattern(groups)
    assert (out / "pattern.txt").read_text() == pattern + "\n"
    assert json.loads((out / "config.json").read_text()) == {"index_topk_pattern": pattern}
    report = json.loads((out / "report.json").read_text())
    assert report["pattern"] == pattern and report["producers"] == [0, 3, 4]
    assert report["rows"] == stack.shape[1] and report["k"] == stack.shape[2]
    assert [step["producers"] for step in report["trajectory"]] == list(range(8, 2, -1))
    np.testing.assert_allclose(report["overlap"], overlap_matrix(list(stack)), atol=1e-6)
    assert report["objective_value"] < report["uniform"]["objective_value"]
    # Layers 0..7 and no config: the freq rule of a model whose every layer is sparse, freqs 2, 3, 4.
    assert [(row["index_topk_freq"], row["producers"]) for row in report["freq_rule"]] == [(2, 5), (3, 4), (4, 3)]
    assert report["freq_rule"][-1]["search_objective_value"] == report["objective_value"]
    for name in ("overlap.png", "objective.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"pattern:   {pattern}" in capsys.readouterr().out

    assert main(["calibrate", "--dump", str(tmp_path / "dump"), "--out", str(out), "--no-plots"]) == 0
    assert json.loads((out / "report.json").read_text())["producers"] == [0, 4]  # default keep 0.25 of 8


def test_calibrate_dump_returns_what_it_wrote(tmp_path):
    groups = [3, 1, 4]
    stack = planted_stack(groups, seed=3)
    write_dump(tmp_path / "dump", stack, list(range(len(stack))))
    found = calibrate.calibrate_dump(tmp_path / "dump", tmp_path / "out", producers=3, plots=False)
    assert found.search.pattern == leaders_pattern(groups) and found.search.producers == [0, 3, 4]
    assert found.layers == tuple(range(8)) and (found.rows, found.k) == stack.shape[1:]
    assert found.source == f"dump {tmp_path / 'dump'}"
    np.testing.assert_allclose(found.overlap, overlap_matrix(list(stack)))
    assert found.adjacent_overlap == pytest.approx(float(np.diag(found.overlap, 1).mean()))
    assert [(b.freq, b.producers) for b in found.freq_rule] == [(2, 5), (3, 4), (4, 3)]
    assert found.search.objective_at(3) == found.search.steps[-1].objective and found.search.objective_at(2) is None
    assert sorted(found.paths) == ["config.json", "pattern.txt", "report.json"]
    report = json.loads(found.paths["report.json"].read_text())
    assert report["dump"] == str(tmp_path / "dump") and report["keep"] is None and report["rows"] == found.rows
    default = calibrate.calibrate_dump(tmp_path / "dump", tmp_path / "out", plots=False)
    assert default.search.steps[-1].producers == 2  # keep 0.25 of 8 when neither keep nor producers is given
    with pytest.raises(calibrate.CalibrationError, match="give exactly one of keep"):
        calibrate.calibrate_dump(tmp_path / "dump", tmp_path / "out", keep=0.5, producers=2, plots=False)


def test_calibrate_dump_places_the_layers_with_a_config_dict(tmp_path):
    config = json.loads((EXAMPLES / "deepseek-v4-flash.json").read_text())
    c4 = c4_layers(config["compress_ratios"])
    stack = np.random.default_rng(0).integers(-1, 64, (len(c4), 4, 8)).astype(np.int32)
    write_dump(tmp_path / "dump", stack, c4)
    assert calibrate.calibrate_dump(tmp_path / "dump", tmp_path / "out", plots=False).freq_rule is None
    found = calibrate.calibrate_dump(tmp_path / "dump", tmp_path / "out", config=config, plots=False)
    assert found.layers == tuple(c4) and {b.freq for b in found.freq_rule} >= {2}
    with pytest.raises(calibrate.DumpError, match=r"sparse layers of the config: missing \[\], unexpected \[2\]"):
        calibrate.calibrate_dump(tmp_path / "dump", tmp_path / "out", config={**config, "compress_ratios": [
            0 if layer == c4[0] else ratio for layer, ratio in enumerate(config["compress_ratios"])]}, plots=False)


def test_calibrate_arrays_takes_torch_indices_and_no_model(tmp_path):
    stack = planted_stack([2, 2], seed=1)
    found = calibrate.calibrate_arrays([3, 5, 7, 9], [torch.from_numpy(a) for a in stack], tmp_path, producers=2,
                                       source="a test", plots=False)
    assert found.search.pattern == "FSFS" and found.search.producers == [3, 7] and found.freq_rule is None
    assert (found.rows, found.k, found.source) == (*stack.shape[1:], "a test")


def test_cli_calibrate_dump_that_is_a_file(tmp_path, capsys):
    (tmp_path / "layer_0.npz").write_bytes(b"")
    assert main(["calibrate", "--dump", str(tmp_path / "layer_0.npz"), "--no-plots", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: --dump {tmp_path / 'layer_0.npz'}: not a directory; expected the dump directory" in err
    assert "Traceback" not in err


def test_cli_calibrate_dump_that_is_missing(tmp_path, capsys):
    assert main(["calibrate", "--dump", str(tmp_path / "nope"), "--no-plots", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: --dump {tmp_path / 'nope'}: no such directory; expected the dump directory" in err


def test_calibrate_arrays_needs_one_array_per_layer(tmp_path):
    stack = planted_stack([2, 2], seed=1)
    for layers in ([0, 1, 2], [0, 1, 2, 3, 4]):
        with pytest.raises(calibrate.CalibrationError, match=rf"layers: {len(layers)} layer ids, but indices holds 4"):
            calibrate.calibrate_arrays(layers, list(stack), tmp_path / "out", producers=1, plots=False)
    assert not (tmp_path / "out").exists()


def test_cli_calibrate_checks_the_dump_against_a_config(tmp_path, capsys):
    config = EXAMPLES / "deepseek-v4-flash.json"
    c4 = c4_layers(json.loads(config.read_text())["compress_ratios"])
    stack = np.random.default_rng(0).integers(-1, 64, (len(c4), 4, 8)).astype(np.int32)
    write_dump(tmp_path / "dump", stack, c4)
    args = ["calibrate", "--dump", str(tmp_path / "dump"), "--out", str(tmp_path / "out"), "--no-plots"]
    assert main([*args, "--config", str(config)]) == 0
    pattern = (tmp_path / "out" / "pattern.txt").read_text().strip()
    plan = LayerPlan.from_config(config, index_topk_pattern=pattern)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert plan.producers == report["producers"]
    assert {row["index_topk_freq"] for row in report["freq_rule"]} >= {2}  # the config's C4 layers, freq 2
    capsys.readouterr()
    assert main(args) == 0
    assert "freq rule: not compared" in capsys.readouterr().out  # C4 layer ids, and no config to place them
    (tmp_path / "dump" / f"layer_{c4[-1]:03d}.pt").unlink(missing_ok=True)
    (tmp_path / "dump" / f"layer_{c4[-1]:03d}.npz").unlink(missing_ok=True)
    capsys.readouterr()
    assert main([*args, "--config", str(config)]) == 2
    assert f"missing [{c4[-1]}]" in capsys.readouterr().err


def test_cli_calibrate_without_matplotlib(tmp_path, capsys, monkeypatch):
    write_dump(tmp_path / "dump", planted_stack([1, 1], seed=0), [0, 1])
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["calibrate", "--dump", str(tmp_path / "dump"), "--out", str(tmp_path / "out")]) == 2
    assert "pip install 'indexcache[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_overlap_names_the_numpy_it_needs(monkeypatch):
    monkeypatch.delattr(np, "bitwise_count")
    with pytest.raises(ImportError, match="numpy >= 2.0"):
        overlap_matrix([np.zeros((1, 1), np.int32)])


def test_cli_calibrate_from_model(tmp_path, capsys, one_thread):
    out = tmp_path / "out"
    args = ["calibrate", "--from-model", "v32-like", "--prompt-len", "48", "--topk", "16", "--out", str(out)]
    assert main([*args, "--producers", "4"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "v32-like" and "not a trained model" in report["weights"]
    assert report["rows"] == 2 * (48 - 16) and report["k"] == 16 and report["prompt_len"] == 48
    assert report["sparse_layers"] == list(range(12)) and report["pattern"].count("F") == 4
    freq4 = next(row for row in report["freq_rule"] if row["index_topk_freq"] == 4)
    assert freq4["producers"] == 4 and freq4["pattern"] == "FFSSSFSSSFSS"
    assert freq4["search_objective_value"] == report["objective_value"] < freq4["objective_value"]
    assert (out / "pattern.txt").read_text() == report["pattern"] + "\n"
    for name in ("overlap.png", "objective.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "random seeded weights, not a trained model" in printed and "index_topk_freq=4 keeps 4" in printed

    for bad, message in (
        ([*args, "--config", str(EXAMPLES / "deepseek-v4-flash.json")], "--config checks a --dump"),
        (["calibrate", "--dump", str(tmp_path), "--topk", "16"], "--topk only applies with --from-model"),
        ([*args[:3], "--prompt-len", "16", "--topk", "16"], "--prompt-len 16 must exceed --topk 16"),
    ):
        assert main(bad) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "--from-model", "v32-like", "--dump", str(tmp_path)])


@pytest.mark.parametrize(("schedule", "overridden_by"), [
    ({"cli_factor": 2}, "cli_factor"),
    ({"indexer_types": ["full", "shared"] * 3}, "indexer_types"),
    ({"cli_factor": 1, "index_topk_freq": 4}, None),
])
def test_cli_calibrate_names_a_config_key_that_would_override_the_pattern(tmp_path, capsys, schedule, overridden_by):
    write_dump(tmp_path / "dump", planted_stack([3, 3], seed=2), list(range(6)))
    config = tmp_path / "model.json"
    config.write_text(json.dumps({"num_hidden_layers": 6, **schedule}))
    args = ["calibrate", "--dump", str(tmp_path / "dump"), "--config", str(config), "--producers", "2", "--no-plots"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    found = calibrate.calibrate_dump(tmp_path / "dump", tmp_path / "out", config=config, producers=2, plots=False)
    assert found.overridden_by == overridden_by and found.search.producers == [0, 3]
    merged = {**json.loads(config.read_text()), **json.loads((tmp_path / "out" / "config.json").read_text())}
    if overridden_by is None:
        assert "note:" not in printed and LayerPlan.from_config(merged).producers == [0, 3]
        return
    assert (f"note:      {config} schedules with {overridden_by}, which takes precedence over index_topk_pattern: "
            f"remove it when you merge config.json") in printed
    assert LayerPlan.from_config(merged).producers == [0, 2, 4]  # what the note warns of
    del merged[overridden_by]
    assert LayerPlan.from_config(merged).producers == [0, 3]


def test_calibrate_model_refuses_a_budget_before_running_the_model(tmp_path, monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("the model ran before the budget was checked")

    monkeypatch.setattr("indexcache.tools.model.calibration.record_dump", no_run)
    from indexcache.tools.model.calibration import calibrate_model

    for budget, message in (
        ({"producers": 13}, "producers=13: must be an integer in 1..12 (the sparse layers)"),
        ({"keep": 1.5}, "keep=1.5: must be a fraction in (0, 1]"),
        ({"keep": 0.5, "producers": 2}, "give exactly one of keep"),
    ):
        with pytest.raises(calibrate.CalibrationError, match=re.escape(message)):
            calibrate_model("v32-like", tmp_path / "out", plots=False, **budget)
    with pytest.raises(calibrate.CalibrationError, match=re.escape("producers=10: must be an integer in 1..9")):
        calibrate_model("v4-like", tmp_path / "out", producers=10, plots=False)  # its 9 C4 layers
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", ["0", "1.5", "-0.25", "nan", "inf", "half"])
def test_cli_calibrate_refuses_a_keep_out_of_range_before_any_work(tmp_path, capsys, monkeypatch, keep):
    monkeypatch.setattr("indexcache.tools.model.calibration.record_dump", None)  # a model run would fail
    for source in (["--from-model", "v32-like"], ["--dump", str(tmp_path / "missing")]):
        with pytest.raises(SystemExit) as exit_:
            main(["calibrate", *source, "--keep", keep, "--out", str(tmp_path / "out")])
        assert exit_.value.code == 2
        shown = repr(keep) if keep == "half" else keep
        assert f"argument --keep: expected a fraction in (0, 1], got {shown}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_calibrate_names_layers_that_copy_the_previous_layer(tmp_path, capsys, v32_dump):
    """A dump recorded with some layers shared holds the producer's rows again for them (IndexRecorder records what a
    shared layer reused): their overlap of 1 made the freq rule that recorded it look lossless, without a word."""
    stack = planted_stack([2, 2, 2], seed=4)
    stack[2] = stack[1]  # layer 2 recorded shared after producer 1, layer 3 after it
    stack[3] = stack[1]
    write_dump(tmp_path / "dump", stack, list(range(6)))
    assert main(["calibrate", "--dump", str(tmp_path / "dump"), "--producers", "2", "--no-plots",
                 "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "note:      layers 2, 3 hold exactly the previous sparse layer's indices in every row" in printed
    assert json.loads((tmp_path / "out" / "report.json").read_text())["copies_of_previous_layer"] == [2, 3]
    found = calibrate.calibrate_arrays([4, 6, 8, 10, 12, 14], list(stack), tmp_path / "out", producers=2, plots=False)
    assert found.copies == (8, 10)
    stack[3, -1, 0] = stack[3, -1, 0] + 1  # one index of one row differs: its own selection
    assert calibrate.calibrate_arrays(range(6), list(stack), tmp_path / "out", producers=2, plots=False).copies == (2,)
    layers, arrays = v32_dump  # every layer a producer
    assert calibrate.calibrate_arrays(layers, arrays, tmp_path / "out", producers=3, plots=False).copies == ()


def test_calibrate_dump_refuses_a_bad_config_or_budget_before_reading_the_dump(tmp_path, monkeypatch):
    def no_read(path):
        raise AssertionError("the dump was read before the config and the budget were checked")

    monkeypatch.setattr("indexcache.tools.calibrate.calibration.load_dump", no_read)
    config = {"num_hidden_layers": 6, "index_topk_freq": 4}
    for model, budget, error, message in (
        ({**config, "index_topk_freq": 0}, {}, ConfigError, "index_topk_freq=0: must be an integer >= 1"),
        (config, {"producers": 7}, calibrate.CalibrationError, "producers=7: must be an integer in 1..6"),
        ({**config, "num_nextn_predict_layers": 1}, {"producers": 7}, calibrate.CalibrationError,
         "producers=7: must be an integer in 1..6"),  # the MTP layer is no dumped layer
        (config, {"keep": 0.0}, calibrate.CalibrationError, "keep=0.0: must be a fraction in (0, 1]"),
    ):
        with pytest.raises(error, match=re.escape(message)):
            calibrate.calibrate_dump(tmp_path / "dump", tmp_path / "out", config=model, plots=False, **budget)
