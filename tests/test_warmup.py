"""Kernel variants and ``indexcache warmup`` (docs/kernels.md, "Kernel variants"): the variants a deployment can
launch are a bounded set that does not grow with the batch or the context; any shape of the serving sweep launches
only listed variants; the launcher's key is Triton's on each; and a warmed variant is what Triton's own launch path
finds in its cache. Everything here is computed from the launch builders on meta tensors (no GPU); the last test
compiles two small kernels for sm90 on the CPU."""

from __future__ import annotations

import collections
import importlib
import itertools
import os
import pkgutil
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

import indexcache  # noqa: E402
import indexcache.backends.triton as _triton_backend  # noqa: E402
from indexcache.backends.cuda.tuning import tuning as cuda_tuning  # noqa: E402
from indexcache.backends.triton import crosscompile, logits, variants  # noqa: E402
from indexcache.backends.triton.launcher import planning, settle_cache_keys  # noqa: E402
from indexcache.plan import LayerPlan  # noqa: E402
from indexcache.tools import cli  # noqa: E402
from indexcache.tools.warmup import decode_calls, prefill_calls, shape_points, warmup  # noqa: E402

# Every kernel module imported now, at collection, before a test elsewhere sets TRITON_INTERPRET=1: Triton decides
# at import whether a kernel is interpreted, and warmup needs them compiled (all of them: one first imported under a
# test that interprets, as test_public.py's do, would hand the sweep interpreted launchers).
for _module in pkgutil.walk_packages(_triton_backend.__path__, _triton_backend.__name__ + "."):
    importlib.import_module(_module.name)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "examples" / "configs" / "deepseek-v3.2.json")
PLAN = LayerPlan.from_config(CONFIG)
# The serving sweep: decode batch 1-64, contexts up to 128K, next_n 1-2; prefill up to 8K tokens.
SWEEP = dict(max_batch=256, max_context=131072, max_next_n=2, max_prefill=8192)


def _per_kernel(found) -> collections.Counter:
    return collections.Counter(v.kernel for v in found.variants)


def test_shape_points_meet_every_power_of_two_class():
    assert shape_points(1) == [1]
    assert shape_points(20) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 20]
    for n in range(1, 300):  # an interval (a, 2a] holds a power of two: every next_power_of_2 class is met
        assert any(p <= n and triton.next_power_of_2(p) == triton.next_power_of_2(n) for p in shape_points(n))
    with pytest.raises(ValueError, match="limit: expected a size >= 1, got 0"):
        shape_points(0)


# Per kernel, the product of its classes for one deployment: the finishing launch's gather widths (7) and the
# sample's sizes (7) and the block top-k's sample entries a thread (3) or its rows sampled ahead (1: their records,
# from BLOCK_SAMPLE_ROWS rows on), times the call patterns (decode at next_n 1 and 2, prefill: 3; the sample and
# filter 2, row starts or not); the decode's next_n; the prefill's logits stride (1, a multiple of 16, another) with
# the -inf fill (mqa_logits) or without (the prefill producer); translate with requests or without; the short rows'
# step at next_n 1 and 2 and the prefill producer's (docs/kernels.md, "Kernel variants").
# The split rows' kernels (sample, filter, finish) keep the scores' row stride's class, a multiple of 16 or not: twice
# the classes of their other arguments. Rows sampled ahead take AHEAD_SAMPLE_RANK's sample size (64 to 4096 entries,
# by columns / k), not the block's own: the sample launch's four call patterns of theirs at each size class.
BOUNDS = {"topk_finish_kernel": 42, "topk_sample_kernel": 44, "topk_filter_kernel": 4, "topk_block_kernel": 12,
          "paged_mqa_logits_kernel": 2, "paged_decode_sm90_kernel": 2, "mqa_logits_kernel": 6,
          "prefill_sm90_kernel": 6, "translate_kernel": 2, "store_kernel": 1, "quantize_kernel": 1,
          "draft_rows_kernel": 1, "short_rows_kernel": 3, "gather_index_k_kernel": 1, "windows_kernel": 1}


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_the_variants_are_a_product_of_classes_and_do_not_grow_with_the_batch(arch):
    """NVIDIA (on AMD a tensor's span, under 2 GiB or not, is a class of Triton's own: docs/kernels.md). Before, the
    finishing launch alone had 189 variants at these limits."""
    small = warmup(PLAN, arch=arch, compile=False, **SWEEP)
    large = warmup(PLAN, arch=arch, compile=False, **dict(SWEEP, max_batch=4096))
    assert _per_kernel(small) == _per_kernel(large)
    assert {v.key for v in small.variants} == {v.key for v in large.variants}
    over = {k: n for k, n in _per_kernel(small).items() if n > BOUNDS[k]}
    assert not over, over


def test_the_variant_count_stops_growing_with_the_context_past_its_classes():
    """Past 1M keys (64 chunks of 4K, the most the finishing launch gathers at once, the largest sample; and every
    class of the row stride the split kernels keep) no context adds a variant, up to 4M."""
    counts = {n: _per_kernel(warmup(PLAN, arch="sm90", compile=False, **dict(SWEEP, max_context=n)))
              for n in (1048576, 4194304)}
    assert counts[1048576] == counts[4194304]
    assert counts[1048576]["topk_finish_kernel"] <= 45, counts[1048576]


def _sweep_launches(target, tuning):
    """Launches of the issue's sweep at sizes that are not the listed points (batch 5, contexts 777, ...)."""
    fp8 = target.fp8_dtype
    for batch, context, next_n in itertools.product((1, 5, 13, 24, 37, 64), (100, 777, 4000, 10000, 50000, 131072),
                                                    (1, 2)):
        for op, args in decode_calls(PLAN, 64, fp8, batch, context, next_n):
            yield from variants.op_launches(op, args, target, tuning)
    for tokens, keys in ((100, 100), (1000, 1000), (3000, 9000), (8192, 8192), (7, 100000), (500, 131072)):
        for op, args in prefill_calls(PLAN, 64, fp8, tokens, keys):
            yield from variants.op_launches(op, args, target, tuning)


def test_any_shape_of_the_sweep_launches_only_listed_variants():
    """Cold, the serving sweep compiles no kernel the list does not name: batch, context and prompt length of each
    call choose a variant among the listed ones (before: the prefill's program count, the split filter's chunk and
    the workspace views' alignment gave new ones)."""
    listed = warmup(PLAN, arch="sm90", compile=False, **SWEEP)
    target = crosscompile.gpu_target("cuda", "sm90")
    with planning(132):
        swept = variants.distinct(_sweep_launches(target, cuda_tuning("sm90")), target.gpu.triton_target())
    missing = {v.line() for v in swept} - {v.line() for v in listed.variants}
    assert not missing, "\n".join(sorted(missing))
    assert {v.key for v in swept} <= {v.key for v in listed.variants}


def test_the_launchers_key_is_tritons_on_the_sweep():
    """Over the sweep's launches the launcher tells apart exactly what Triton's own key does (never coarser, and
    no finer: a variant Triton reuses is one the launcher reuses)."""
    target = crosscompile.gpu_target("cuda", "sm90")
    gpu = target.gpu.triton_target()

    def rule(t, align):  # NVIDIA's tensor rule (BaseBackend's)
        return align and t.data_ptr() % 16 == 0

    pairs = collections.defaultdict(set)
    with planning(132):
        for launch in _sweep_launches(target, cuda_tuning("sm90")):
            ours = (launch.options, *launch.launcher._classes(variants._values(launch), rule))
            pairs[launch.launcher.__name__].add((ours, variants.specialize(launch, gpu)[0]))
    for kernel, found in pairs.items():
        ours, theirs = {a for a, _ in found}, {b for _, b in found}
        assert len(ours) == len(found) == len(theirs), kernel


def test_cli_lists_the_same_count_for_512_and_4096_requests(capsys):
    counts = []
    for batch in ("512", "4096"):
        assert cli.main(["warmup", "--config", CONFIG, "--arch", "sm90", "--list", "--max-batch", batch]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[-1].endswith(f"kernel variants for {CONFIG} on sm90")
        counts.append(int(lines[-1].split()[0]))
        assert counts[-1] == len(lines) - 1 and len(set(lines[:-1])) == counts[-1]
    assert counts[0] == counts[1]


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-context", "0"], "argument --max-context: expected an integer in 1..134217728, got 0"),
    (["--jobs", "0"], "argument --jobs: expected an integer >= 1, got 0"),
    # past the limits: a traceback from a meta tensor's size, an error naming the workspace bound, a count that grew
    # with every draft token
    (["--max-batch", "9" * 26], "argument --max-batch: expected an integer in 1..1048576, got 9999"),
    (["--max-context", str(2**28)], "argument --max-context: expected an integer in 1..134217728, got 268435456"),
    (["--max-next-n", "17"], "argument --max-next-n: expected an integer in 1..16, got 17"),
])
def test_cli_refuses_sizes_out_of_range(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["warmup", "--config", CONFIG, "--list", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--arch", "tpu7"], "--arch: expected an NVIDIA ('sm90', ...) or AMD ('gfx942', ...) architecture, got 'tpu7'"),
    (["--arch", "sm75"], "--sms: no default multiprocessor count for 'sm75'"),
    (["--arch", "gfxzz", "--sms", "8"], "--arch: expected an AMD architecture such as 'gfx942', got 'gfxzz'"),
    (["--arch", "sm9", "--sms", "8"], "--arch: expected an NVIDIA architecture such as 'sm90', got 'sm9'"),
])
def test_cli_refuses_an_unknown_target(argv, message, capsys):
    """The error names the flag (it named the library's argument: ``arch: ...``, ``sms: ...``)."""
    assert cli.main(["warmup", "--config", CONFIG, "--list", *argv]) == 2
    assert capsys.readouterr().err.startswith(f"indexcache warmup: error: {message}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_without_a_gpu_the_arch_must_be_named(capsys):
    assert cli.main(["warmup", "--config", CONFIG, "--list"]) == 2
    assert "error: --arch: no GPU is visible here; name the target architecture" in capsys.readouterr().err


def test_a_bf16_index_cache_is_refused_with_its_reason():
    with pytest.raises(ValueError, match="index_dtype bfloat16 is not handled"):
        warmup(LayerPlan(4, index_dtype="bfloat16"), arch="sm90", compile=False)


@pytest.mark.parametrize("arch", ["sm90", "sm80", "gfx942", "sm100", "gfx950"])
def test_an_mxfp4_deployment_lists_its_decode_and_key_kernels_and_no_more_with_the_batch(arch):
    """An MXFP4 index cache: the decode reads it (the kernel's MXFP4 variants), the prefill widens its keys once and
    runs the fp8 prefill (its widening and far-key kernels listed; sm80's prefill is the torch backend's) or, where
    the target has a block-scaled instruction, reads them (MXFP4 variants); both read MXFP4 queries too (their
    ``Q_FP4`` variants); the keys are written by the MXFP4 store and quantization; on NVIDIA the count stops growing
    with the batch past its classes (on AMD a tensor's span, under 2 GiB or not, is a class of its own)."""
    plan = LayerPlan.from_config(CONFIG, index_dtype="float4_e2m1fn_x2")
    found = warmup(plan, arch=arch, compile=False, max_batch=512, max_context=8192, max_prefill=2048)
    lines = [v.line() for v in found.variants]
    assert any("paged_mqa_logits_kernel" in line and "MXFP4=0" not in line for line in lines)
    assert any(line.startswith("paged_mqa_logits_kernel") and "Q_FP4=1" in line for line in lines)
    assert any(line.startswith("mxfp4_kernel") for line in lines)
    prefill = [line for line in lines if line.startswith(("mqa_logits_kernel", "prefill_sm90_kernel"))]
    fp8_queries = [line for line in prefill if "Q_FP4=1" not in line]
    widening = [line for line in lines if line.startswith(("widen_keys_kernel", "far_keys_kernel"))]
    assert bool(prefill) == (arch != "sm80")  # sm80: no fp8 matrix instructions, the torch backend's prefill
    assert (len(fp8_queries) < len(prefill)) == (arch != "sm80")  # the MXFP4 queries' prefill: the same kernel
    if arch in ("sm100", "gfx950"):  # block-scaled: the prefill kernel reads the MXFP4 keys
        assert all("MXFP4=0" not in line for line in prefill) and not widening
    elif arch != "sm80":  # widened once: the fp8 prefill, the widening and the far keys' kernels
        assert all("MXFP4=0" in line or "MXFP4" not in line for line in fp8_queries)
        assert {line.split()[0] for line in widening} == {"widen_keys_kernel", "far_keys_kernel"}
    if arch.startswith("sm"):
        more = warmup(plan, arch=arch, compile=False, max_batch=4096, max_context=8192, max_prefill=2048)
        assert {v.key for v in more.variants} == {v.key for v in found.variants}


@pytest.mark.parametrize("arch", ["sm90", "gfx942"])
@pytest.mark.parametrize(("heads", "dim"), [(64, 96), (48, 128)])
def test_heads_or_a_head_dim_the_logits_decline_list_no_logits_kernel(tmp_path, arch, heads, dim):
    """A model whose indexer the Triton logits kernels decline (heads or head dim not a power of two, or the dim out of
    [32, 256]) runs its logits and producer steps on the torch backend: warmup lists none of their kernels (it listed
    a variant of each, which nothing would launch), and still the key store and the top-k it does launch."""
    import json

    config = json.loads(Path(CONFIG).read_text())
    config.update(index_n_heads=heads, index_head_dim=dim)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    plan = LayerPlan.from_config(str(path))
    kernels = {v.kernel for v in warmup(plan, arch=arch, compile=False, max_batch=64, max_context=8192,
                                        max_prefill=2048).variants}
    assert logits.declined_shape(torch.empty(1, heads, dim, device="meta"))
    assert not {k for k in kernels if "logits" in k or "sm90" in k or k.startswith(("widen", "far", "head"))}
    assert {"store_kernel", "quantize_kernel", "translate_kernel"} <= kernels and any("topk" in k for k in kernels)
    full = {v.kernel for v in warmup(PLAN, arch=arch, compile=False, max_batch=64, max_context=8192,
                                     max_prefill=2048).variants}
    assert any("logits" in k for k in full)


def test_a_cache_directory_that_cannot_be_written_is_refused_before_any_compile(tmp_path, monkeypatch, capsys):
    """It failed in a worker part of the way through, with NotADirectoryError's traceback."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    monkeypatch.setattr(variants, "warm", lambda *a, **k: pytest.fail("compiled with an unwritable cache"))
    assert cli.main(["warmup", "--config", CONFIG, "--arch", "sm90"]) == 2
    assert "TRITON_CACHE_DIR: Triton's cache directory" in capsys.readouterr().err
    assert cli.main(["warmup", "--config", CONFIG, "--arch", "sm90", "--list"]) == 0  # listing writes nothing


def test_interpreted_triton_compiles_nothing_and_says_so(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(variants, "warm", lambda *a, **k: pytest.fail("compiled under TRITON_INTERPRET=1"))
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1: Triton interprets the kernels here and compiles none; "
                                         r"unset it \(listing them, compile=False or --list, takes it\)"):
        warmup(PLAN, arch="sm90")
    assert cli.main(["warmup", "--config", CONFIG, "--arch", "sm90"]) == 2
    assert "TRITON_INTERPRET=1: Triton interprets the kernels here" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["sm90", "gfx942"])
def test_listing_with_triton_interpreting_gives_the_same_variants(arch, capsys):
    """``--list`` under TRITON_INTERPRET=1 from the process start (its kernels imported interpreted, the Gluon ones
    calling interpreted functions) lists what a process with compiled kernels lists, line for line."""
    import subprocess
    import sys

    argv = ["warmup", "--config", CONFIG, "--arch", arch, "--list", "--max-batch", "8", "--max-context", "4096",
            "--max-prefill", "1024"]
    assert cli.main(argv) == 0
    want = capsys.readouterr().out
    done = subprocess.run([sys.executable, "-m", "indexcache.tools.cli", *argv], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == want and int(want.splitlines()[-1].split()[0]) > 20


def test_the_package_exports_warmup():
    assert indexcache.warmup is warmup


def test_warming_this_machines_gpu_also_prepares_the_first_calls(monkeypatch, fresh_dispatch):
    """On this machine's GPU (no ``arch``) ``warmup`` loads what it compiled and prepares the dispatch, so the first op
    call sets nothing up (no GPU here: the target, the compiles and the loads stood in)."""
    from triton.runtime.driver import driver

    import indexcache.tools.warmup as warmup_module

    steps = []
    monkeypatch.setattr(warmup_module, "_device_arch", lambda: ("cuda", "sm90"))
    monkeypatch.setattr(driver, "_active", variants._TargetOnly(crosscompile.gpu_target("cuda", "sm90").gpu
                                                                .triton_target()))
    monkeypatch.setattr(variants, "warm", lambda found, gpu, jobs, progress: steps.append("warm") or {})
    monkeypatch.setattr(variants, "load", lambda found: steps.append("load"))
    monkeypatch.setattr(fresh_dispatch, "prepare", lambda: steps.append("prepare") or "cuda")
    warmup(PLAN, sms=132, max_batch=2, max_context=300, max_prefill=2)
    assert steps == ["warm", "load", "prepare"]
    steps.clear()
    warmup(PLAN, sms=132, max_batch=2, max_context=300, max_prefill=2, load=False)
    assert steps == ["warm"]


class _Recorder:
    """A compilation listener: whether each compile Triton ran found its kernel in the cache."""

    def __init__(self):
        self.hits: list[bool] = []

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit):
        self.hits.append(cache_hit)


def test_a_warmed_variant_is_what_a_launch_looks_up(tmp_path, monkeypatch):
    """``warm`` compiles in another process, through the kernel's own warmup; then Triton's launch path here (the
    JIT, its key from the same arguments, the same target) finds the entry: a cache hit, no compile. A variant
    that was not warmed is compiled."""
    from triton import knobs
    from triton.runtime.driver import driver

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    found = warmup(PLAN, arch="sm90", compile=False, **SWEEP).variants
    small = [v for v in found if v.kernel in ("draft_rows_kernel", "translate_kernel")]
    warmed, cold = small[:2], small[2:]
    assert [v.kernel for v in small] == ["translate_kernel", "translate_kernel", "draft_rows_kernel"]
    gpu = crosscompile.gpu_target("cuda", "sm90").gpu.triton_target()
    assert len(variants.warm(warmed, gpu, jobs=1)) == 2
    recorder = _Recorder()
    monkeypatch.setattr(knobs.compilation, "listener", recorder)
    monkeypatch.setattr(driver, "_active", variants._TargetOnly(gpu))  # the H200's target, as its driver names it
    settle_cache_keys()  # as the Launcher does before its first compile
    for v in small:
        fn = v.launch.launcher.fn
        monkeypatch.setattr(fn, "device_caches", collections.defaultdict(fn.create_binder))  # no kernel in memory
        fn.warmup(*v.launch.args, grid=(1,), **v.launch.named, **dict(v.launch.options))
    assert recorder.hits == [True] * len(warmed) + [False] * len(cold)


_UNGUARDED = """
import sys, triton
from indexcache.backends.triton import crosscompile, variants
from indexcache.plan import LayerPlan
from indexcache.tools.warmup import warmup

found = warmup(LayerPlan.from_config(sys.argv[1]), arch="sm90", compile=False, max_batch=2, max_context=300,
               max_prefill=2).variants
variants.warm(found[:1], crosscompile.gpu_target("cuda", "sm90").gpu.triton_target(), jobs=1)
"""


def test_a_script_warming_up_unguarded_is_told_how_to_guard_it(tmp_path):
    """The compile workers are spawned and import the main script again: without the ``__main__`` guard they fail
    at start, and the error says what to write."""
    import subprocess
    import sys

    script = tmp_path / "serve.py"
    script.write_text(_UNGUARDED)
    done = subprocess.run([sys.executable, str(script), CONFIG], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode != 0
    assert "needs the call under `if __name__ == '__main__':`" in done.stderr.splitlines()[-1]


def _coldstart():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("bench_coldstart_gpu", ROOT / "bench" / "coldstart_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("kind", "dims"), [("decode", (3, 200, 2)), ("decode", (1, 100, 1)),
                                            ("prefill", (100, 300))])
def test_the_coldstart_sweep_makes_the_calls_warmup_lists(kind, dims):
    """bench/coldstart_gpu.py runs the calls of decode_calls / prefill_calls on real tensors of the same shapes,
    strides and dtypes, sharing what they share."""
    bench = _coldstart()
    fp8 = torch.float8_e4m3fn
    meta = decode_calls(PLAN, 64, fp8, *dims) if kind == "decode" else prefill_calls(PLAN, 64, fp8, *dims)
    real = bench.materialize(kind, meta, dims, fp8, torch.device("cpu"))
    assert [op for op, _ in real] == [op for op, _ in meta]
    pairs = {}
    for (op, m), (_, r) in zip(meta, real, strict=True):
        for name, value in r.items():
            if isinstance(value, torch.Tensor):
                assert (value.shape, value.stride(), value.dtype) == (m[name].shape, m[name].stride(), m[name].dtype)
                assert pairs.setdefault(id(m[name]), value) is value, f"{op} {name}: shared in the meta calls"
            else:
                assert value == m[name], f"{op} {name}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path")
def test_coldstart_smoke_runs_the_sweep_on_the_cpu(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "coldstart.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "coldstart_gpu.py"), "--smoke", "--phases",
                           "cold,deepgemm", "--calls", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    rows = report["cold"]["shapes"]
    assert [(r["kind"], tuple(r["shape"])) for r in rows] == _coldstart().shapes(smoke=True)
    assert all(r["first_ms"] > 0 and r["steady_ms"] > 0 and r["new_buffers_ms"] > 0 for r in rows)
    assert all(0 < r["first_host_ms"] <= r["first_ms"] and r["first_device_allocs"] == 0 for r in rows)  # no GPU
    # each shape's first call after steps of the shape before (as in an engine), the first shape's after none
    assert [r["host_rewarmed"] for r in rows] == [False] + [True] * (len(rows) - 1) and not report["cold_host"]
    assert "first / new buffers median" in done.stdout
    assert "absent" in report["deepgemm"] or report["deepgemm"]["shapes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path")
def test_coldstart_smoke_of_every_phase_passes_on_the_cpu_and_says_it_is_no_gpu_run(tmp_path):
    """The default phases' smoke run failed off a GPU (its warm phase asked indexcache.warmup for this machine's GPU)
    and printed its CPU times as a GPU run's, unlabelled; the warm phase now lists sm90's variants, none compiled."""
    import json
    import subprocess
    import sys

    out = tmp_path / "coldstart.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "coldstart_gpu.py"), "--smoke", "--calls", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["gpu"] is None and "not a GPU run" in report["notice"]
    assert done.stdout.startswith(report["notice"] + "\n")
    warm = report["warm"]
    assert warm["warmup"]["variants"] > 0 and "none compiled" in warm["warmup"]["listed_only"]
    assert "compile_seconds" not in warm["warmup"] and len(warm["shapes"]) == len(report["cold"]["shapes"])
    assert "none compiled" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_coldstart_without_smoke_refuses_to_run_on_the_cpu(tmp_path):
    """Off a GPU the full sweep ran on the CPU (up to a gigabyte of inputs a shape) and wrote its times as a report;
    like the other GPU scripts it now asks for --smoke."""
    import subprocess
    import sys

    out = tmp_path / "coldstart.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "coldstart_gpu.py"), "--phases", "deepgemm",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "no GPU visible" in done.stdout and not out.exists(), done.stdout + done.stderr


def test_the_function_refuses_sizes_past_its_limits():
    with pytest.raises(ValueError, match=r"^max_next_n: expected an int in \[1, 16\], got 17"):
        warmup(PLAN, arch="sm90", compile=False, **dict(SWEEP, max_next_n=17))


def test_an_amd_target_id_warms_its_processor():
    """``--arch`` as torch's ``gcnArchName`` gives it (the target ID with its feature flags) lists the processor's
    variants under its name (before: ValueError naming the flags)."""
    sizes = dict(max_batch=3, max_context=256, max_next_n=1, max_prefill=16)
    found = warmup(PLAN, arch="gfx942:sramecc+:xnack-", compile=False, **sizes)
    plain = warmup(PLAN, arch="gfx942", compile=False, **sizes)
    assert found.target == "gfx942" and [v.key for v in found.variants] == [v.key for v in plain.variants]
