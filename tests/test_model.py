"""The small DSA model end to end: plans, pipeline stages, micro-batches, prefill vs decode, and (on a
GPU) a captured decode step replayed against eager."""

import dataclasses
import importlib.util
import json
import os
import types

import pytest
import torch

import indexcache
from indexcache.hal import dispatch
from indexcache.plan import LayerPlan
from indexcache.runtime.runner import IndexerRunner
from indexcache.runtime.state import IndexRecorder, TopkState
from indexcache.tools import cli
from indexcache.tools.calibrate.overlap import overlap_matrix
from indexcache.tools.model.batch import Batch
from indexcache.tools.model.calibration import calibrate_model
from indexcache.tools.model.comparison import compare_plans
from indexcache.tools.model.config import ModelSettingError, preset
from indexcache.tools.model.demo import plot_demo, run_demo
from indexcache.tools.model.dsa import DSAModel
from indexcache.tools.model.static_decode import StaticDecode

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = preset("v32-like", num_layers=8, hidden=64, heads=2, head_dim=32, index_heads=2, topk=16, page_size=8,
             vocab=64, window=16)
PROMPTS = (48, 30)
STEPS = 3
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


@pytest.fixture(scope="module")
def model():
    return DSAModel(CFG)


def prompts(lengths=PROMPTS, seed=0, vocab=CFG.vocab):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@pytest.fixture(scope="module")
def freq1(model):
    recorder = IndexRecorder()
    return model.generate(prompts(), STEPS, IndexerRunner(model.plan(1)), recorder=recorder), recorder


def test_all_producer_pattern_equals_freq_1_exactly(model, freq1):
    base, _ = freq1
    got = model.generate(prompts(), STEPS, IndexerRunner(model.plan(pattern="F" * CFG.num_layers)))
    assert torch.equal(got.prefill_logits, base.prefill_logits)
    assert torch.equal(got.decode_logits, base.decode_logits)
    assert torch.equal(got.tokens, base.tokens)


def test_freq_4_differs_from_freq_1_and_reports_its_overlap(model, freq1):
    base, recorder = freq1
    plan = model.plan(4)
    got = model.generate(prompts(), STEPS, IndexerRunner(plan), tokens=base.tokens)
    assert not torch.equal(got.prefill_logits, base.prefill_logits)
    drift = (got.decode_logits - base.decode_logits).norm() / base.decode_logits.norm()
    assert 0 < drift < 1
    indices = recorder.stacked()
    overlap = overlap_matrix([indices[layer] for layer in range(CFG.num_layers)])
    shared = {layer: overlap[layer, plan.source_of(layer)] for layer in plan.shared}
    assert all(0 < v <= 1 for v in shared.values())
    # Seeded blocks of 4: layers 2 and 3 reuse layer 1 of their own block, layer 4 reuses it across blocks.
    assert min(shared[2], shared[3]) > 0.7 > 0.5 > shared[4]


def test_a_forward_decides_its_overlap_schedule_once_for_all_its_layers(model, monkeypatch):
    """One ``overlap_schedule`` a forward (the prefill and each decode step), whatever the layer count: every layer of
    a forward has the same rows and context (docs/streams.md, "Deciding once a forward")."""
    from indexcache.tools.model import dsa

    made = []
    real = dsa.overlap_schedule
    monkeypatch.setattr(dsa, "overlap_schedule", lambda **named: made.append(named) or real(**named))
    model.generate(prompts(), 2, IndexerRunner(model.plan(2)))
    assert len(made) == 3  # the prefill and two decode steps, over CFG.num_layers layers each
    assert [m["tokens"] for m in made] == [sum(PROMPTS), len(PROMPTS), len(PROMPTS)]


def test_prefill_then_decode_equals_a_longer_prefill(model):
    plan = IndexerRunner(model.plan(2))
    (prompt,) = prompts((40,))
    longer = model.generate([prompt], 0, plan).prefill_logits
    shorter = model.generate([prompt[:-1]], 1, plan, tokens=prompt[-1:, None]).decode_logits[0]
    torch.testing.assert_close(shorter, longer, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_at_freq_4_equals_one_prefill(model):
    runner = IndexerRunner(model.plan(4))
    (prompt,) = prompts((44,))
    cache = model.new_cache(1, 64)
    state = TopkState(64, CFG.topk)
    tables = cache.tables_for([0])
    whole = model.run(Batch.prefill([prompt], tables), cache, runner, state)[-1]
    cache = model.new_cache(1, 64)
    model.run(Batch.prefill([prompt[:25]], tables), cache, runner, state)
    chunked = model.run(Batch.prefill([prompt[25:]], tables, prefix_lens=[25]), cache, runner, state)[-1]
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)


def forward_stages(model, plan, stages, batch_tokens, carry=True):
    cache = model.new_cache(len(batch_tokens), 64)
    batch = Batch.prefill(batch_tokens, cache.tables_for(range(len(batch_tokens))))
    x = model.embed(batch)
    received = None
    for stage in stages:
        runner = IndexerRunner(plan, stage=stage)
        state = TopkState(batch.rows, CFG.topk)
        if stage.carry_in is not None:
            assert carry
            state.load_carry(*received)
        else:
            runner.begin(state, batch.rows)
        x = model.forward(x, batch, cache, runner, state)
        if stage.carry_out is not None:
            raw, header = state.to_carry()
            received = raw.clone(), header
    return model.head(x)


def test_pipeline_carry_equals_the_unsplit_run(model):
    plan = model.plan(4)
    tokens = prompts()
    whole = forward_stages(model, plan, plan.split_stages([]), tokens)
    stages = plan.split_stages([3, 6], mode="carry")
    assert [s.carry_in for s in stages] == [None, 1, 5]
    assert torch.equal(forward_stages(model, plan, stages, tokens), whole)


def test_pipeline_promote_equals_the_promoted_plan(model):
    plan = model.plan(4)
    tokens = prompts()
    stages = plan.split_stages([3], mode="promote")
    promoted = LayerPlan(CFG.num_layers, index_topk_pattern="".join(s.roles for s in stages), index_topk=CFG.topk,
                         page_size=CFG.page_size)
    assert promoted.producers == [0, 1, 3, 5]
    split = forward_stages(model, plan, stages, tokens, carry=False)
    assert torch.equal(split, forward_stages(model, promoted, promoted.split_stages([]), tokens))
    assert not torch.equal(split, forward_stages(model, plan, plan.split_stages([]), tokens))


def interleaved(model, runner, batches, states):
    """Run the micro-batches layer by layer in turn (two-batch overlap's order) on one cache."""
    cache = model.new_cache(2, 64)
    built = [Batch.prefill([t], cache.tables_for([slot])) for slot, t in enumerate(batches)]
    xs = [model.embed(b) for b in built]
    for b, state in zip(built, states, strict=True):
        runner.begin(state, b.rows)
    for layer in runner.layers:
        xs = [model.layer(layer, x, b, cache, runner, state) for x, b, state in zip(xs, built, states, strict=True)]
    return [model.head(x) for x in xs]


def test_two_micro_batches_with_their_own_states_equal_sequential_forwards(model):
    runner = IndexerRunner(model.plan(4))
    a, b = prompts((36, 36), seed=3)
    cache = model.new_cache(2, 64)
    state = TopkState(36, CFG.topk)
    sequential = [model.run(Batch.prefill([t], cache.tables_for([slot])), cache, runner, state)
                  for slot, t in enumerate((a, b))]
    separate = interleaved(model, runner, (a, b), (TopkState(36, CFG.topk), TopkState(36, CFG.topk)))
    assert all(torch.equal(s, p) for s, p in zip(separate, sequential, strict=True))
    one = TopkState(36, CFG.topk)
    shared_state = interleaved(model, runner, (a, b), (one, one))
    assert not torch.equal(shared_state[0], sequential[0]), "one state for both micro-batches mixes them up"


def test_empty_batch_runs_and_clears_the_state(model):
    runner = IndexerRunner(model.plan(4))
    cache = model.new_cache(1, 64)
    state = TopkState(64, CFG.topk)
    model.run(Batch.prefill(prompts((40,)), cache.tables_for([0])), cache, runner, state)
    logits = model.run(Batch.prefill([], cache.tables_for([])), cache, runner, state)
    assert logits.shape == (0, CFG.vocab)
    assert bool((state.raw == -1).all())


def test_v4_like_preset_runs_windowed_and_sparse_layers():
    cfg = preset("v4-like", num_layers=8, compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128), hidden=64, heads=2,
                 head_dim=32, index_heads=2, topk=16, page_size=8, vocab=64, window=16)
    v4 = DSAModel(cfg)
    plan = v4.plan(2)
    assert plan.roles == "..F.S.F."
    got = v4.generate(prompts(vocab=64), 2, IndexerRunner(plan))
    assert got.decode_logits.shape == (2, 2, 64)
    assert bool(torch.isfinite(got.decode_logits).all())


def test_presets_and_bad_names():
    assert preset("v32-like").topk == 2048 and preset("v32-like").compress_ratios is None
    assert preset("v4-like").topk == 512 and 4 in preset("v4-like").compress_ratios
    assert preset("v32-like", topk=64).topk == 64
    with pytest.raises(ValueError, match="preset"):
        preset("v5")


@pytest.mark.parametrize(("override", "message"), [
    ({"block": 0}, "block: expected an integer >= 1, got 0"),
    ({"hidden": 0}, "hidden: expected an integer >= 1, got 0"),
    ({"vocab": 0}, "vocab: expected an integer >= 1, got 0"),
    ({"heads": 2.0}, "heads: expected an integer >= 1, got 2.0"),
    ({"index_dim": 96}, "index_dim: expected a power of two >= 4, got 96"),
    ({"block_share": 1.5}, "global_share, block_share: expected 0 <= global_share <= block_share <= 1, got 0.3, 1.5"),
    ({"global_share": 0.995}, "global_share, block_share: expected 0 <= global_share <= block_share <= 1, got 0.995"),
    ({"index_dtype": "bogus"}, "index_dtype: expected float8_e4m3fn or float8_e4m3fnuz or float4_e2m1fn_x2, got "
                               "'bogus'"),
    ({"index_dtype": "bfloat16"}, "index_dtype: expected float8_e4m3fn or .*, got 'bfloat16'"),
    ({"seed": 2**70}, r"seed: expected an integer in 0\.\.18446744073709551615 .*, got 1180591620717411303424"),
    ({"seed": -1}, r"seed: expected an integer in 0\.\."),
    ({"compress_ratios": (0, 0) + (4, 128) * 9}, r"compress_ratios: expected 8 ratios \(one a layer, num_layers\), "
                                                 r"each 0, 4, 128, got \(0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, "),
    ({"compress_ratios": (0, 4, 5, 4, 4, 4, 4, 4)}, r"compress_ratios: expected 8 ratios .*, got \(0, 4, 5, 4"),
    ({"compress_ratios": (0, 4, True, 4, 4, 4, 4, 4)}, r"compress_ratios: expected 8 ratios .*, got \(0, 4, True"),
], ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_a_config_the_model_cannot_be_built_with_is_refused(override, message):
    """DSAModel refuses a config setting it cannot use with a ModelSettingError naming it, before any weight is
    drawn: block 0, hidden 0 and vocab 0 raised ZeroDivisionError or a RuntimeError of torch, shares out of order
    "math domain error", an unknown index_dtype an AttributeError of torch; compress_ratios that do not fit the layers
    (v4-like's 20 ratios on 8 layers) built a model whose sparse_layers named layers it does not have, refused only
    later, by its plan, with the plan's ConfigError."""
    with pytest.raises(ModelSettingError, match=f"^{message}"):
        DSAModel(dataclasses.replace(CFG, **override))


@gpu
def test_captured_decode_step_replays_like_eager_without_allocating():
    """Decode steps of the model, captured once and replayed with changing batches (short and long
    contexts mixed, padding rows) equal eager steps, and replays allocate nothing."""
    replays = int(os.environ.get("INDEXCACHE_GRAPH_REPLAYS", "1000"))
    cfg = dataclasses.replace(CFG, topk=64)
    model = DSAModel(cfg, "cuda")
    runner = IndexerRunner(model.plan(4))
    requests, max_len, max_batch = 16, 512, 8
    cache = model.new_cache(requests, max_len)
    store_args = dict(k=torch.zeros(1, cfg.index_dim, device="cuda"), k_cache=cache.index_k[0],
                      slot_mapping=torch.zeros(1, dtype=torch.int32, device="cuda"), fp8_dtype=model.fp8)
    store_backend = dispatch.resolve("store_index_k", store_args)[0]
    if store_backend == "torch":
        pytest.skip("store_index_k resolves to the torch backend, whose store picks valid slots with "
                    "torch.nonzero (a host sync) and cannot be captured; needs a graph-safe store")
    g = torch.Generator(device="cuda").manual_seed(0)
    slots = cache.kv.shape[1] - 1
    cache.kv.copy_(torch.randn(cache.kv.shape, device="cuda", generator=g))
    for k_cache in cache.index_k.values():  # a context's worth of index keys in every slot
        keys = torch.randn(slots, cfg.index_dim, device="cuda", generator=g)
        indexcache.store_index_k(keys, k_cache, torch.arange(slots, dtype=torch.int32, device="cuda"), model.fp8)
    static = StaticDecode(model, cache, runner, max_batch)
    graph = static.capture()

    cpu = torch.Generator().manual_seed(1)
    allocated, empty_slots = 0, 0
    for i in range(replays):
        b = int(torch.randint(1, max_batch + 1, (1,), generator=cpu))
        reqs = torch.randperm(requests, generator=cpu)[:b]
        short = torch.randint(1, cfg.topk, (b,), generator=cpu)
        long = torch.randint(cfg.topk + 1, max_len + 1, (b,), generator=cpu)
        seq_lens = torch.where(torch.rand(b, generator=cpu) < 0.5, short, long).to(torch.int32)
        tokens = torch.randint(0, cfg.vocab, (b,), generator=cpu)
        static.load(tokens.cuda(), seq_lens.cuda(), cache.tables_for(reqs))
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        graph.replay()
        allocated += torch.cuda.memory_stats()["allocation.all.allocated"] - before
        replayed, raw = static.logits.clone(), static.state.raw.clone()
        static.step()
        torch.testing.assert_close(replayed, static.logits, rtol=1e-5, atol=1e-5, msg=f"replay {i}")
        assert torch.equal(raw, static.state.raw), f"replay {i}: top-k indices differ"
        empty_slots += int((raw[:b] == -1).sum())
    assert allocated == 0
    assert empty_slots > 0


def test_compare_plans_times_each_plan_after_an_untimed_run_of_both(model, monkeypatch):
    """The plan timed first paid the kernels' compiles and first calls (on a GPU: seconds): both run once untimed
    first, on the same prompts, then the timed runs, the baseline's tokens fed to the plan's."""
    runs, generate = [], DSAModel.generate

    def recording(self, prompts, steps, runner, **named):
        runs.append((len(runner.plan.producers), steps, named.get("tokens") is not None))
        return generate(self, prompts, steps, runner, **named)

    monkeypatch.setattr(DSAModel, "generate", recording)
    plan = model.plan(4)
    compare_plans(model, plan, prompts(), 3)
    every = len(model.plan(1).producers)
    assert runs == [(every, 1, False), (len(plan.producers), 1, False), (every, 3, False),
                    (len(plan.producers), 3, True)]


def test_compare_plans_reports_overlap_and_drift(model):
    result = compare_plans(model, model.plan(4), prompts(), 2)
    assert sorted(result.overlap) == list(range(CFG.num_layers))
    assert all(result.overlap[layer] == 1.0 for layer in result.plan.producers)
    assert 0 < result.prefill_drift < 1 and 0 < result.decode_drift < 1
    assert 0 <= result.agreement <= 1
    assert torch.equal(result.candidate.tokens, result.baseline.tokens)


def test_run_demo_compares_the_freq_plan_with_freq_1(tmp_path):
    demo = run_demo("v32-like", freq=4, backend="torch", batch=1, prompt_len=40, decode_steps=2, topk=16, seed=1)
    assert (demo.name, demo.backend, demo.device, demo.batch, demo.prompt_len, demo.steps) == (
        "v32-like", "torch", dispatch.availability("torch").device, 1, 40, 2)
    assert demo.config.topk == 16 and demo.config.seed == 1
    result = demo.comparison
    assert result.plan.roles == DSAModel(demo.config).plan(4).roles
    assert result.baseline.decode_logits.shape[0] == 2 and torch.equal(result.candidate.tokens, result.baseline.tokens)
    if importlib.util.find_spec("matplotlib"):
        assert plot_demo(result, tmp_path / "o.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_demo_refuses_a_comparison_without_decode_steps(model, tmp_path):
    """compare_plans(..., steps=0) measures no overlaps: plot_demo says so (it raised KeyError: 0)."""
    result = compare_plans(model, model.plan(2), prompts((9, 13)), 0)
    assert result.overlap == {} and result.agreement == 1.0
    with pytest.raises(ValueError, match=r"^comparison: compared no decode steps, so it has no overlaps to plot"):
        plot_demo(result, tmp_path / "o.png")
    assert not (tmp_path / "o.png").exists()


def test_demo_refuses_a_prompt_shorter_than_topk(monkeypatch, capsys):
    """The demo measures overlaps on decode steps: with contexts of at most k tokens every layer selects every token,
    and `indexcache demo --prompt-len 64` (k 128 on a CPU) printed overlap 1.000 for every layer and no drift. k given
    (the default is the preset's 2048 where the torch backend runs on a GPU)."""
    with pytest.raises(ModelSettingError, match=r"^prompt_len=64 must be at least topk=128: the overlaps are measured"):
        run_demo(backend="torch", prompt_len=64, topk=128, decode_steps=1)
    assert cli.main(["demo", "--backend", "torch", "--prompt-len", "64", "--topk", "128", "--decode-steps", "2"]) == 2
    assert "error: --prompt-len 64 must be at least --topk 128: " in capsys.readouterr().err

    class Built(Exception):
        pass

    def build(*args):
        raise Built

    monkeypatch.setattr("indexcache.tools.model.demo.DSAModel", build)
    with pytest.raises(Built):  # a prompt of k tokens: every decode step's context exceeds k
        run_demo(backend="torch", prompt_len=16, topk=16, decode_steps=1)


def test_runs_refuse_settings_they_cannot_use(monkeypatch):
    with pytest.raises(ModelSettingError, match="batch=0: must be an integer >= 1"):
        run_demo(batch=0)
    with pytest.raises(ModelSettingError, match="preset: expected one of"):
        run_demo("v5-like", backend="torch")
    with pytest.raises(dispatch.UnknownBackendError):
        run_demo(backend="bogus")
    monkeypatch.setattr(dispatch, "availability", lambda name: types.SimpleNamespace(available=False, reason="gone"))
    with pytest.raises(ModelSettingError, match="backend 'torch' is not available here: gone"):
        run_demo(backend="torch")


def test_calibrate_model_records_and_searches(tmp_path):
    found = calibrate_model("v32-like", tmp_path, producers=4, prompt_len=48, topk=16, plots=False)
    assert found.layers == tuple(range(12)) and (found.rows, found.k) == (2 * (48 - 16), 16)
    assert found.search.pattern.count("F") == 4 and "not a trained model" in found.source
    assert next(b for b in found.freq_rule if b.freq == 4).pattern == "FFSSSFSSSFSS"
    report = json.loads(found.paths["report.json"].read_text())
    assert (report["model"], report["prompt_len"], report["topk"]) == ("v32-like", 48, 16) and "seed" not in report


def test_demo_command_prints_phases_overlap_drift_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "overlap.png"
    argv = ["demo", "--backend", "torch", "--prompt-len", "40", "--topk", "16", "--decode-steps", "2", "--batch", "1",
            "--plot", str(png)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for text in ("not a trained model", "freq 1", "freq 4", "prefill s", "decode ms/step", "mean overlap",
                 "drift from freq 1"):
        assert text in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as exc:  # argparse's one-line error, before any work
        cli.main(["demo", "--batch", "0"])
    assert exc.value.code == 2


def test_demo_command_names_the_flags_of_a_run_too_large(monkeypatch, capsys):
    """A run refused for its memory names the sizes as the command's flags, as `calibrate --from-model` does (it
    named run_demo's arguments: `prompt_len=100000, decode_steps=3`)."""
    from indexcache.tools.model import checks

    monkeypatch.setattr(checks, "free_bytes", lambda device: 2**30)
    argv = ["demo", "--backend", "torch", "--prompt-len", "100000", "--decode-steps", "3", "--topk", "16"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: --batch 2, --prompt-len 100000, --decode-steps 3, --topk 16: the run needs at least" in err
    assert "Traceback" not in err


def test_short_prompts_skip_the_producers_indexer_and_select_what_it_would(model):
    """Prompts and steps no longer than k (16): every producer skips its scores (the batch's ``max_length``) and the
    run equals one whose runner ignores the bound, logits, tokens and every layer's indices alike."""

    class Ungated(IndexerRunner):
        def layer(self, *args, max_length=None, **kwargs):
            return super().layer(*args, **kwargs)

    short = prompts((9, 13))
    scored = []
    model._index_scores = lambda *a, **kw: scored.append(a[0]) or DSAModel._index_scores(model, *a, **kw)
    try:
        want_rec, got_rec = IndexRecorder(), IndexRecorder()
        want = model.generate(short, 3, Ungated(model.plan(2)), recorder=want_rec)
        calls = len(scored)
        got = model.generate(short, 3, IndexerRunner(model.plan(2)), recorder=got_rec)
    finally:
        del model._index_scores
    assert calls > 0 and len(scored) == calls, "the gated run must not score"
    assert torch.equal(got.prefill_logits, want.prefill_logits) and torch.equal(got.decode_logits, want.decode_logits)
    assert torch.equal(got.tokens, want.tokens)
    assert got_rec.stacked().keys() == want_rec.stacked().keys()
    assert all(torch.equal(got_rec.stacked()[layer], want_rec.stacked()[layer]) for layer in want_rec.stacked())
