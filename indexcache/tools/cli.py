"""The ``indexcache`` command. Each subcommand registers itself through one ``_add_*`` function; its ``_run_*``
function parses what argparse cannot check, calls the library and prints.

Bad input (a :class:`UsageError`, or one of the library's input errors a subcommand names in
:func:`_input_errors`) is one line on stderr and exit status 2; any other exception is a bug and propagates
with its traceback. Library modules are imported inside the subcommands (only the pure-Python plan's bounds at the
top, for the options' ranges), so ``indexcache plan`` never imports torch; every other command first checks that
the torch installed is one indexcache runs on (:mod:`indexcache.hal.torch_version`; else exit status 2). Sizes are
checked when the arguments are parsed, the environment and the output paths (by writing there) before any work.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from indexcache.plan import MAX_LAYERS, MAX_TOPK, SERVING_LIMITS


class UsageError(Exception):
    """Bad input from the command line: printed on stderr, exit status 2, no traceback."""


@contextlib.contextmanager
def _input_errors(*errors: type[Exception], flags: Iterable[str] = ()) -> Iterator[None]:
    """Turn the library's input errors ``errors`` raised inside into a :class:`UsageError`; anything else
    propagates. A library argument the message names as ``name=`` (or leads with as ``name:``) that is one of
    ``flags`` (the command's argparse dests) is named as its flag: ``producers=40`` reads ``--producers 40``,
    ``backend: expected ...`` ``--backend: expected ...``."""
    try:
        yield
    except errors as exc:
        message = str(exc)
        for name in flags:
            flag = f"--{name.replace('_', '-')}"
            message = re.sub(rf"(?<![\w-]){name}= ?", f"{flag} ", re.sub(rf"^{name}: ", f"{flag}: ", message))
        raise UsageError(message) from exc


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high`` (``high`` None: no upper bound), else the usual one-line
    ``error: argument --x: ...`` and exit status 2, before any work."""
    expected = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"

    def parse(text: str) -> int:
        digits = text.strip().removeprefix("-").removeprefix("+")
        if not (digits.isascii() and digits.isdigit()):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text[:40]!r}")
        value = int(text) if len(digits) <= 40 else None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text[:40]}")
        return value

    return parse


def _fraction(text: str) -> float:
    """An argparse type: a fraction in (0, 1], else the usual one-line ``error: argument --x: ...`` and exit status 2,
    before any work (a dump read or a model run)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text[:40]!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text[:40]}")
    return value


def _check_environment() -> None:
    """Refuse, before any work, a bad ``INDEXCACHE_TORCH_MEMORY_BUDGET``: whatever runs ops may run the torch
    backend (the fallback of every other), and conformance's workers would each fail on it."""
    from indexcache.backends.torch.memory import MemoryBudgetError, env_budget

    with _input_errors(MemoryBudgetError):
        env_budget()


def _need_triton(command: str) -> None:
    """Refuse, before any work, a command that needs Triton where it is absent or fails to import, saying which."""
    from indexcache.backends.triton.target import triton_import

    version, missing = triton_import()
    if version is None:
        raise UsageError(f"{command} needs Triton: {missing} (pip install triton)")


def _check_input(option: str, path: str | os.PathLike[str]) -> None:
    """Refuse, before any work, an input file ``path`` that cannot be read (missing, a directory, no permission)."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot read {option} {path}: {exc.strerror}") from None


def _check_output(option: str, path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """Refuse, before any work, an output ``path`` (a file, or with ``directory`` a folder) that cannot be written.

    Missing folders on the way are fine (the writers create them); the nearest existing one must be a writable folder.
    Writing is tried, not inferred from permission bits (which root, a read-only mount or /proc do not follow): the
    missing folders are made and a scratch file is created where the output goes, then both are removed again.
    """
    target, kind = Path(path), "directory" if directory else "file"
    if os.path.exists(target):
        if target.is_dir() != directory:
            found = "directory" if target.is_dir() else "file"
            raise UsageError(f"{option} {path}: expected a {kind}, got an existing {found}")
        if not os.access(target, os.W_OK | (os.X_OK if directory else 0)):
            raise UsageError(f"{option} {path}: expected a writable {kind}, got one without write permission")
    parent = target.absolute().parent
    while not os.path.exists(parent):
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: expected a directory at {parent}, got a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: cannot create it in {parent} (no write permission)")
    folder = target.absolute() if directory else target.absolute().parent
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None
    finally:
        for p in made:  # deepest first; only what this check created, and only while empty
            with contextlib.suppress(OSError):
                p.rmdir()


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="which backend is selected and why; every backend's availability")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_info)


def _run_info(args) -> int:
    import json

    from indexcache.hal.dispatch import UnknownBackendError
    from indexcache.tools.backend_status import backend_status

    _check_environment()
    with _input_errors(UnknownBackendError):
        summary = backend_status()
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"selected backend: {summary['selected']} ({summary['why']})")
    for b in summary["backends"]:
        state = f"available, {b['mode']} on {b['device']}" if b["available"] else "not available"
        print(f"  {b['name']:<8} {state}: {b['reason']}")
    return 0


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="which layers compute top-k and which reuse it, from a model config")
    p.add_argument("--config", required=True, metavar="PATH", help="the model's config.json")
    p.add_argument("--freq", type=_int_in(1, MAX_LAYERS),
                   help="override index_topk_freq (a producer every N sparse layers)")
    p.add_argument("--pattern", help="override index_topk_pattern (F/S per layer or per sparse layer)")
    p.add_argument("--offset", type=_int_in(1, MAX_LAYERS), help="override index_skip_topk_offset")
    p.add_argument("--page-size", type=_int_in(1),
                   help="index-K cache tokens a page (default: the config's page_size, else 64)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_plan)


def _run_plan(args) -> int:
    import json

    from indexcache.plan import ConfigError, LayerPlan
    from indexcache.plan.descriptor import Descriptor

    if args.pattern is not None and (args.freq is not None or args.offset is not None):
        raise UsageError("give --pattern or --freq/--offset, not both")
    _check_input("--config", args.config)
    with _input_errors(ConfigError):
        plan = LayerPlan.from_config(
            args.config,
            index_topk_freq=args.freq,
            index_skip_topk_offset=args.offset,
            index_topk_pattern=args.pattern,
            page_size=args.page_size,
        )
    signature = Descriptor.from_plan(plan).signature
    if args.json:
        out = {
            "roles": plan.roles,
            "producers": plan.producers,
            "shared": plan.shared,
            "sources": {str(layer): src for layer, src in plan.sources.items()},
            "signature": signature,
        }
        print(json.dumps(out))
        return 0
    sparse = len(plan.sparse_layers)
    print(f"config:    {args.config} (schedule from {plan.schedule})")
    print(f"roles:     {plan.roles}")
    print("           F computes top-k, S reuses the nearest earlier F, . has no indexer")
    print(
        f"layers:    {plan.num_layers} ({plan.num_mtp_layers} MTP), {sparse} sparse: "
        f"{len(plan.producers)} producers, {len(plan.shared)} shared"
    )
    print(f"producers: {', '.join(map(str, plan.producers))}")
    print(f"signature: {signature}")
    return 0


def _add_conformance(sub) -> None:
    p = sub.add_parser(
        "conformance",
        help="run the conformance suite per backend against the float64 reference; write reports",
        description="Run every conformance case on each backend (each in its own process) and compare with the "
        "float64 reference. Default: the selected backend plus every other available one; 'all' adds the "
        "Triton backends interpreted on the CPU (TRITON_INTERPRET=1) where their GPU is absent (left out, saying "
        "why, where Triton is absent or fails to import). A backend's report "
        "from an earlier run is deleted before it runs. Prints a backend x op table, then each case that was declined "
        "or failed with its reason, then a line for each backend on which no case ran and for each op of which no case "
        "ran on a backend that ran others. Exits 1 if any case fails (a decline without a reason fails), no case ran "
        "on a backend (every case declined: nothing was checked), or a backend's process crashes, runs past --timeout "
        "or writes no report; an op whose every case was declined while the backend's other ops ran is a line, not a "
        "failure.",
    )
    p.add_argument("--backend", default=None, metavar="NAME|all", help="one backend, or 'all'")
    p.add_argument("--out", default="reports", help="directory for conformance-<backend>.json/.md (default: reports)")
    p.add_argument("--op", default=None, help="only the cases of this op (an op of the case catalogue)")
    p.add_argument("--compile", action="store_true", help="also cross-compile the cuda/rocm kernels for each GPU "
                   "generation (as indexcache compile-check) and add a 'compiled for' section to their reports (a run "
                   "without either backend is refused)")
    p.add_argument("--jobs", type=int, default=1, help="processes each backend's cases are dealt to (default 1): "
                   "on a GPU with an empty Triton cache the kernels then compile side by side")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="kill a backend's processes after this many seconds and count it as crashed (default: none)")
    p.set_defaults(func=_run_conformance)


def _run_conformance(args) -> int:
    from indexcache.backends.triton.target import vendors
    from indexcache.conformance.suite import not_passed, run_all, table, unchecked_lines
    from indexcache.conformance.worker import catalogue_ops
    from indexcache.hal import dispatch
    from indexcache.hal.dispatch import BackendNotSupportedError, UnknownBackendError

    if args.op is not None and args.op not in catalogue_ops():
        raise UsageError(f"--op: expected one of {catalogue_ops()}, got {args.op!r}")
    if args.jobs < 1:
        raise UsageError(f"--jobs: expected an int >= 1, got {args.jobs}")
    if args.timeout is not None and not args.timeout > 0:  # NaN too
        raise UsageError(f"--timeout: expected a number of seconds > 0, got {args.timeout:g}")
    if args.backend not in (None, "all", *dispatch.registry()):
        raise UsageError(f"--backend: expected one of {sorted(dispatch.registry())} or 'all', got {args.backend!r}")
    _check_environment()
    _check_output("--out", args.out, directory=True)
    out = Path(args.out)
    with _input_errors(UnknownBackendError, BackendNotSupportedError, flags=("backend",)):  # not one that can't run
        if args.compile and args.backend != "all":  # "all" runs the Triton backends, interpreted without their GPU
            if args.backend is not None:
                dispatch.get(args.backend)  # an unknown name is that error
            planned = dispatch.available_backends() if args.backend is None else [args.backend]
            if not set(planned) & set(vendors()):  # it would be ignored: no report to add it to
                raise UsageError(f"--compile: adds the cross-compile check to the {' and '.join(vendors())} reports, "
                                 f"and this run has neither (backends: {', '.join(planned)}); add --backend all "
                                 "(interpreted where their GPU is absent) or name one of them")
        reports, ok = run_all(args.backend, out, args.op, compile_check=args.compile, jobs=args.jobs,
                              timeout=args.timeout)
    print(table(reports))
    for line in not_passed(reports):
        print(f"  {line}")
    for line in unchecked_lines(reports):
        print(line)
    if reports:
        written = ", ".join(f"conformance-{r['backend']}" for r in reports)
        print(f"reports written to {out}: {written} (.json and .md)")
    return 0 if ok else 1


# The ops without a case of `indexcache bench` (no bench record in their spec): their own scripts time them.
UNBENCHED = {"hisparse_plan": "bench/hisparse_gpu.py", "hisparse_swap_in": "bench/hisparse_swap_gpu.py"}


def _add_bench(sub) -> None:
    from indexcache.hal.specs import OP_NAMES  # pure Python: the parser is built for every command

    p = sub.add_parser(
        "bench",
        help="measure the machine's ceilings, then each op per backend; print a table",
        description="Measure the ceilings the requested ops need (copy bandwidth; for the logits ops also the fp8 "
        "torch._scaled_mm and bf16 matmul rates, on 8192^3 on a GPU) and an empty Triton launch, then time each "
        "case of each op on each backend (checked against the torch backend first: translate exactly, logits by "
        "-inf placement and relative error, top-k by each row's index set, the producer steps by their logits or "
        "selection and translate, the index-cache ops byte for byte; torch always runs, as the speed-up "
        "baseline). mqa_logits is set against the matmul rate of its dtype (TFLOP/s of in-window pairs), "
        "mqa_topk_translate against the fp8 one; paged_mqa_logits against copy bandwidth (132 bytes a cached "
        "token, 4 a logit), as are translate, paged_topk_translate, quantize_index_k, store_index_k and "
        "gather_index_k; topk and topk_translate against one read of their scores, with torch.topk as an extra "
        "row. Off a GPU, times are labelled CPU / interpreted and are not speeds. Exits 1 if a backend disagrees "
        "with torch or fails.",
    )
    p.add_argument("--op", action="append", default=None, metavar="NAME",
                   help=f"an op to time: {', '.join(n for n in OP_NAMES if n not in UNBENCHED)} (repeatable; "
                   f"default: every one; {' and '.join(UNBENCHED)} are timed by "
                   f"{' and '.join(UNBENCHED.values())})")
    p.add_argument("--backend", action="append", default=None, metavar="NAME",
                   help="a backend to time (repeatable; default: every available backend implementing the op)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--quick", action="store_true", help="small shapes and few repeats (for tests)")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    from indexcache.bench import failed, format_table, run, write_json
    from indexcache.bench.harness import OPS
    from indexcache.hal.dispatch import UnknownBackendError

    _check_environment()
    if args.json:
        _check_output("--json", args.json)
    unknown = [name for name in args.op or () if name not in OPS]
    if unknown:
        raise UsageError(f"--op: expected one of {sorted(OPS)}, got {', '.join(map(repr, unknown))}")
    with _input_errors(UnknownBackendError, flags=("backend",)):
        report = run(args.op, args.backend, quick=args.quick)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"results written to {args.json}")
    bad = failed(report)
    for row in bad:
        print(f"FAILED {row['op']} / {row['case']} / {row['backend']}: {row['check']}", file=sys.stderr)
    return 1 if bad else 0


def _add_calibrate(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="choose the F/S pattern from a dump of every layer's top-k indices (overlap + greedy search)",
        description="Read one top-k index file per sparse layer (layer_<id>.pt or .npz, [rows, k] int32, -1 = "
        "empty; see indexcache.tools.calibrate), or record them from a seeded prefill of the small random-weight "
        "model (--from-model; not a trained model), measure how much every pair of layers' selections "
        "overlap, and search greedily for the producers to keep: starting from all-F, repeatedly turn into a "
        "shared layer the producer whose loss lowers the mean overlap with its source least. Compares with "
        "evenly spaced producers and the index_topk_freq rule. Writes pattern.txt, config.json, report.json, "
        "overlap.png and objective.png, all at once when the run is done (a write that fails leaves --out as it "
        "was); with --no-plots, an earlier run's plots in --out are removed and listed.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--dump", metavar="DIR", help="directory with one top-k file per sparse layer")
    source.add_argument(
        "--from-model", choices=("v32-like", "v4-like"), help="record the top-k of every sparse layer (all "
        "producers) in a seeded prefill of this small model preset (random weights, not a trained model)"
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--keep", type=_fraction, metavar="FRACTION", help="fraction of sparse layers kept as producers, rounded up "
        "(default 0.25)"
    )
    budget.add_argument("--producers", type=_int_in(1), metavar="COUNT", help="number of producers to keep instead")
    p.add_argument("--out", default="calibration", metavar="DIR", help="output directory (default: calibration)")
    p.add_argument(
        "--config", metavar="PATH", help="the model's config.json: check that the dump holds exactly its sparse layers"
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (they need matplotlib); an earlier run's "
                   "PNGs in --out are removed")
    p.add_argument("--threads", type=_int_in(1), default=None, help="row blocks processed at once (default: all CPUs)")
    model = p.add_argument_group("--from-model options")
    model.add_argument("--backend", metavar="NAME", help="run the model on this backend (default: automatic)")
    model.add_argument("--prompt-len", type=_int_in(1), metavar="N", help="tokens a prompt, 2 prompts (default 512; "
                       "rows whose context is at most --topk are dropped; a run that cannot fit in memory is refused "
                       "before it starts)")
    model.add_argument("--topk", type=_int_in(1, MAX_TOPK), metavar="K", help="top-k, at most 65536 (default 128, "
                       "scaled down for a CPU; the presets' own: 2048 v32-like, 512 v4-like)")
    model.add_argument("--seed", type=_int_in(0), metavar="N", help="seed of the weights and prompts, 64 bits "
                       "(default 0)")
    p.set_defaults(func=_run_calibrate)


def _run_calibrate(args) -> int:
    import json
    from functools import partial

    from indexcache.hal.dispatch import UnknownBackendError
    from indexcache.plan import ConfigError
    from indexcache.tools import calibrate, model

    _check_output("--out", args.out, directory=True)
    if args.from_model is not None:
        _check_environment()
    if not args.no_plots:
        try:
            calibrate.check_plotting()
        except ImportError as exc:
            raise UsageError(f"{exc} (or pass --no-plots)") from None
    options = {name: getattr(args, name) for name in ("backend", "prompt_len", "topk", "seed")}
    errors = (calibrate.CalibrationError, ConfigError, model.ModelSettingError, UnknownBackendError)
    if args.from_model is not None:
        if args.config is not None:
            raise UsageError("--config checks a --dump against a model's config; --from-model knows its layers")
        run = partial(model.calibrate_model, args.from_model, **options)
    else:
        given = [name for name, value in options.items() if value is not None]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} only applies with --from-model")
        if args.config is not None:
            _check_input("--config", args.config)
        if not os.path.isdir(args.dump):
            found = "not a directory" if os.path.exists(args.dump) else "no such directory"
            raise UsageError(f"--dump {args.dump}: {found}; expected the dump directory of layer_<id> files")
        run = partial(calibrate.calibrate_dump, args.dump, config=args.config)
        errors += (FileNotFoundError,)  # a --dump directory without layer files (missing or a file: refused above)
    with _input_errors(*errors, flags=vars(args)):
        found = run(args.out, keep=args.keep, producers=args.producers, threads=args.threads, plots=not args.no_plots)
    search, layers = found.search, found.layers
    last = search.steps[-1]
    print(f"source:    {found.source}: {len(layers)} sparse layers ({layers[0]}..{layers[-1]}), {found.rows} rows, "
          f"k {found.k}")
    print(f"overlap:   {found.overlap_seconds:.2f} s (CPU); adjacent layers share {found.adjacent_overlap:.3f} on "
          "average")
    print(f"producers: {last.producers} of {len(layers)}: {', '.join(map(str, search.producers))}")
    print(f"pattern:   {search.pattern}")
    print(f"config:    {json.dumps(search.config())}")
    print(f"objective: overlap loss {last.objective:.4f} (evenly spaced producers: {last.uniform_objective:.4f})")
    for baseline in found.freq_rule or ():
        print(
            f"freq rule: index_topk_freq={baseline.freq} keeps {baseline.producers}: overlap loss "
            f"{baseline.objective:.4f} (search at {baseline.producers}: {search.objective_at(baseline.producers):.4f})"
        )
    if found.freq_rule is None:
        print("freq rule: not compared (pass --config: the dump's layer ids are not 0..n-1)")
    if found.copies:
        print(f"note:      layers {', '.join(map(str, found.copies))} hold exactly the previous sparse layer's indices "
              "in every row, so sharing them looks free: recorded with those layers shared, or on contexts of at "
              "most k tokens? Record with every layer a producer, on longer contexts")
    if found.overridden_by is not None:
        print(f"note:      {args.config} schedules with {found.overridden_by}, which takes precedence over "
              f"index_topk_pattern: remove it when you merge config.json, or the plan keeps {found.overridden_by}'s "
              "producers")
    print(f"wrote:     {', '.join(str(path) for path in found.paths.values())}")
    if found.removed:
        removed = ", ".join(str(path) for path in found.removed)
        print(f"removed:   {removed} (an earlier run's plots; --no-plots draws none)")
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="run a small random-weight DSA model with every layer a producer and with IndexCache; compare",
        description="Run the small DSA model of indexcache.tools.model (random seeded weights, NOT a trained model; "
        "neighbouring indexers are correlated on purpose so top-k overlaps look like a trained model's) with "
        "freq 1 and with --freq, prefill then decode, on the selected backend. Prints the time of each phase, "
        "the top-k overlap between each shared layer and its producer, and how far the outputs drift from freq 1.",
    )
    p.add_argument("--preset", default="v32-like", choices=("v32-like", "v4-like"),
                   help="the small model's layout: v32-like (every layer sparse, top-k 2048) or v4-like "
                   "(DeepSeek-V4's compress_ratios: only ratio-4 layers have an indexer, top-k 512) (default v32-like)")
    p.add_argument("--freq", type=_int_in(1, MAX_LAYERS), default=4,
                   help="index_topk_freq to compare with freq 1 (default 4)")
    p.add_argument("--backend", default=None, metavar="NAME", help="run every op on this backend (default: automatic)")
    p.add_argument("--batch", type=_int_in(1), default=2, help="requests (default 2)")
    p.add_argument("--prompt-len", type=_int_in(1), default=None, help="prompt tokens a request (default 4096 on a "
                   "GPU, 512 on a CPU)")
    p.add_argument("--decode-steps", type=_int_in(1), default=None, help="decode steps (default 32 on a GPU, 8 on a "
                   "CPU)")
    p.add_argument("--topk", type=_int_in(1, MAX_TOPK), default=None, help="top-k, at most 65536 (default: the "
                   "preset's on a GPU, 128 on a CPU)")
    p.add_argument("--seed", type=_int_in(0), default=0, help="seed of the weights and prompts, 64 bits (default 0)")
    p.add_argument("--plot", default=None, metavar="PATH", help="save a PNG of the overlap by layer")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from indexcache.hal.dispatch import UnknownBackendError
    from indexcache.tools.calibrate import check_plotting
    from indexcache.tools.model import ModelSettingError, plot_demo, preset, run_demo

    _check_environment()
    if args.plot:
        _check_output("--plot", args.plot)
        try:
            check_plotting()
        except ImportError as exc:
            raise UsageError(str(exc)) from None
    with _input_errors(ModelSettingError, UnknownBackendError, flags=vars(args)):
        demo = run_demo(args.preset, freq=args.freq, backend=args.backend, batch=args.batch,
                        prompt_len=args.prompt_len, decode_steps=args.decode_steps, topk=args.topk, seed=args.seed)
    config, result, steps = demo.config, demo.comparison, demo.steps
    plan = result.plan
    sparse = plan.sparse_layers
    preset_topk = preset(args.preset).topk
    scaled = "" if config.topk == preset_topk else f" (preset {preset_topk}; scaled)"
    print(f"model:   {args.preset}, random seeded weights (not a trained model): {config.num_layers} layers, "
          f"{len(sparse)} sparse, top-k {config.topk}{scaled}, page {config.page_size}")
    print(f"backend: {demo.backend} ({demo.mode} on {demo.device}); batch {demo.batch} x {demo.prompt_len} prompt "
          f"tokens, {steps} decode steps")
    print(f"\n{'plan':<10}{'producers':>11}{'prefill s':>12}{'decode ms/step':>16}")
    for label, run, producers in (("freq 1", result.baseline, len(sparse)),
                                  (f"freq {args.freq}", result.candidate, len(plan.producers))):
        print(f"{label:<10}{f'{producers}/{len(sparse)}':>11}{run.prefill_s:>12.3f}"
              f"{1e3 * run.decode_s / steps:>16.2f}")
    print(f"\ntop-k overlap with the producer freq {args.freq} reuses (on freq 1's decode steps; 1 = same tokens):")
    print(f"{'layer':>6}{'role':>6}{'source':>8}{'overlap':>9}{'vs previous sparse layer':>26}")
    for layer in sparse:
        adjacent = f"{result.adjacent[layer]:.3f}" if layer in result.adjacent else "-"
        print(f"{layer:>6}{plan.role(layer):>6}{plan.source_of(layer):>8}{result.overlap[layer]:>9.3f}{adjacent:>26}")
    shared = [result.overlap[layer] for layer in plan.shared]
    if shared:
        print(f"shared layers: mean overlap {sum(shared) / len(shared):.3f}, lowest {min(shared):.3f}")
    print(f"\ndrift from freq 1: prefill logits {result.prefill_drift:.4f}, decode logits {result.decode_drift:.4f} "
          f"(relative L2); greedy tokens agree at {100 * result.agreement:.1f}% of decode positions")
    if args.plot:
        plot_demo(result, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _add_compile_check(sub) -> None:
    p = sub.add_parser(
        "compile-check",
        help="cross-compile every Triton kernel for the GPU generations of cuda/rocm; check registers, spills, "
        "shared memory and matrix instructions",
        description="Compile every kernel configuration the cuda and rocm tuning tables can choose, with Triton, "
        "for sm80, sm89, sm90, sm100, sm120 (cuda) and gfx942, gfx950 (rocm; each for tensors under 2 GiB, buffer "
        "loads, and larger ones), on this machine: no GPU needed, nothing is run. Fails (exit 1) on a compile error, "
        "a spill or scratch use (up to 32 AMD SGPR spills into VGPR lanes, or the more a kernel allows, and the "
        "stack frame a kernel allows, pass), shared memory or threads beyond a block's limit, a "
        "matrix kernel without the target's matrix instructions, or fnuz fp8 on gfx950.",
    )
    p.add_argument("--backend", default="all", choices=("cuda", "rocm", "all"), help="default: all")
    p.add_argument("--target", action="append", default=None, metavar="ARCH",
                   help="only this target, e.g. sm90 or gfx950 (repeatable)")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="compile N targets at a time, each in its own "
                   "process (default 1)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=_run_compile_check)


def _run_compile_check(args) -> int:
    import json

    _need_triton("the compile check")
    from indexcache.backends.triton.crosscompile import TARGETS, check_targets, failed, format_table, to_stderr, why

    backends = list(TARGETS) if args.backend == "all" else [args.backend]
    runs = [(b, arch) for b in backends for arch in TARGETS[b] if not args.target or arch in args.target]
    known = [arch for b in backends for arch in TARGETS[b]]
    if unknown := [t for t in args.target or () if t not in known]:  # one mistyped beside a good one: not dropped
        raise UsageError(f"--target: no target of --backend {args.backend} is {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(known)})")
    if args.jobs < 1:
        raise UsageError(f"--jobs: expected an int >= 1, got {args.jobs}")
    if args.json:
        _check_output("--json", args.json)
    results = check_targets(runs, args.jobs, progress=to_stderr)
    print(format_table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"results written to {args.json}")
    bad = failed(results)
    print(f"{len(results) - len(bad)} of {len(results)} kernel builds pass (cross-compiled, not run)")
    for r in bad:
        print(f"FAILED {r['backend']} {r['target']} {r['kernel'] or r['module']}: {why(r)}", file=sys.stderr)
    return 1 if bad else 0


def _add_warmup(sub) -> None:
    p = sub.add_parser(
        "warmup",
        help="compile every Triton kernel variant a deployment of a model config can launch, ahead of serving",
        description="List the Triton kernel variants a deployment of the model config can launch on a GPU "
        "architecture (its decode steps of 1 to --max-batch requests with contexts up to --max-context and 1 to "
        "--max-next-n tokens a request, its prefill chunks of up to --max-prefill tokens; every batch and length "
        "class, see docs/kernels.md, \"Kernel variants\") and compile them into Triton's cache (TRITON_CACHE_DIR) in "
        "parallel worker processes, so that no first call of a new shape compiles. Run it with the Triton and the "
        "TRITON_* environment the engine runs with. --list prints one line per variant and compiles nothing: it "
        "needs no GPU, for any --arch.",
    )
    p.add_argument("--config", required=True, metavar="PATH", help="the model's config.json")
    p.add_argument("--arch", default=None, help="target architecture, e.g. sm90 or gfx942 (default: this machine's "
                   "GPU)")
    p.add_argument("--page-size", type=_int_in(1), default=None, metavar="P", help="index cache and KV tokens a page "
                   "(default: the config's, else 64)")
    limit = SERVING_LIMITS
    p.add_argument("--max-batch", type=_int_in(1, limit["max_batch"]), metavar="B", help="requests a decode step "
                   "(default 256, at most 2^20)")
    p.add_argument("--max-context", type=_int_in(1, limit["max_context"]), metavar="N", help="keys a request sees "
                   "(default 131072, at most 2^27)")
    p.add_argument("--max-next-n", type=_int_in(1, limit["max_next_n"]), metavar="N", help="tokens a request a "
                   "decode step, MTP drafts included (default 2, at most 16: each adds its own variants)")
    p.add_argument("--max-prefill", type=_int_in(1, limit["max_prefill"]), metavar="T", help="tokens a prefill "
                   "chunk (default 8192, at most 2^27)")
    p.add_argument("--sms", type=_int_in(1), default=None, metavar="N", help="the GPU's multiprocessors (default: "
                   "this GPU's, else the generation's largest data-center part)")
    p.add_argument("--list", action="store_true", help="print one line per variant and compile nothing")
    p.add_argument("--jobs", type=_int_in(1), default=None, metavar="J", help="compile worker processes (default: "
                   "this machine's cores)")
    p.set_defaults(func=_run_warmup)


def _run_warmup(args) -> int:
    _need_triton("warmup")
    from triton import knobs

    from indexcache.plan import ConfigError, LayerPlan
    from indexcache.tools.warmup import warmup

    _check_input("--config", args.config)
    with _input_errors(ConfigError):
        plan = LayerPlan.from_config(args.config, page_size=args.page_size)
    tty = sys.stderr.isatty()

    def progress(done: int, total: int, variant, seconds: float) -> None:
        bar = "#" * (30 * done // total)
        line = f"[{bar:<30}] {done}/{total} {variant.kernel} {seconds:.1f}s"
        print(f"\r{line:<100}" if tty else line, end="" if tty and done < total else "\n", file=sys.stderr,
              flush=True)

    sizes = {name: getattr(args, name) for name in ("max_batch", "max_context", "max_next_n", "max_prefill")
             if getattr(args, name) is not None}
    with _input_errors(ValueError, flags=vars(args)):
        found = warmup(plan, arch=args.arch, sms=args.sms, compile=not args.list, load=False, jobs=args.jobs,
                       progress=progress, **sizes)
    if args.list:
        for variant in found.variants:
            print(variant.line())
        print(f"{len(found.variants)} kernel variants for {args.config} on {found.target}")
        return 0
    longest = max(zip(found.seconds, (v.kernel for v in found.variants), strict=True), default=(0.0, "-"))
    print(f"compiled {len(found.variants)} kernel variants for {args.config} on {found.target} into "
          f"{knobs.cache.dir} in {found.wall:.1f} s (longest: {longest[1]}, {longest[0]:.1f} s)")
    return 0


COMMANDS = (_add_info, _add_conformance, _add_plan, _add_bench, _add_calibrate, _add_demo, _add_compile_check,
            _add_warmup)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="indexcache",
        description="IndexCache: cross-layer reuse of sparse-attention top-k indices, on any backend.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command != "plan":  # every other command builds or runs ops: first a torch they run on
            from indexcache.hal.torch_version import require_torch

            with _input_errors(ImportError):
                require_torch()
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not in the interpreter's flush at exit
        return code
    except UsageError as exc:
        print(f"indexcache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader of stdout went away (``indexcache plan ... | head``): stop quietly, as a shell tool does; the
        # interpreter's own flush at exit would raise again, so stdout goes to /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, a shell's status for a writer whose pipe closed


if __name__ == "__main__":
    sys.exit(main())
