"""Run one case on one backend and judge it against the float64 reference (DESIGN.md's rules).

- integer ops: exact equality;
- top-k: per row the same set of positions as the reference (our tie rule is deterministic, so
  this is stricter than "same multiset of scores"), no duplicates, -1 only in empty slots; exact
  order when ``sorted=True``;
- logits: -inf and NaN positions identical (NaN only where a non-finite input puts it), relative RMS
  error of finite values within the bound of the input dtype and accumulation;
- quantization and the cache store: byte-exact, scales equal (NaN where the reference has NaN).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

import indexcache
from indexcache import dispatch, reference
from indexcache.conformance.cases import Case

# Relative RMS bounds of DESIGN.md by (key dtype kind, accumulation).
BOUNDS = {("fp8", "fp32"): 1e-5, ("fp8", "tensor-core"): 1e-3, ("bf16", "fp32"): 1e-2, ("bf16", "tensor-core"): 1e-2}


@dataclass
class CaseResult:
    """The outcome of one case: status "passed", "failed" or "declined" (the backend does not serve it)."""

    op: str
    case: str
    status: str
    detail: str = ""
    error: float | None = None
    bound: float | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _cpu(x):
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _rows_as_sets(idx: torch.Tensor) -> list[list[int]]:
    return [sorted(v for v in row if v >= 0) for row in idx.tolist()]


def _check_topk(got: torch.Tensor, want: torch.Tensor, sort: bool) -> str:
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if sort:
        bad = (got != want).any(1).nonzero().flatten()
        return f"rows {bad[:5].tolist()} differ from the sorted reference" if bad.numel() else ""
    for r, (g, w) in enumerate(zip(got.tolist(), want.tolist(), strict=True)):
        picked = [v for v in g if v != -1]
        if len(set(picked)) != len(picked):
            return f"row {r}: duplicate indices"
        if sorted(picked) != sorted(v for v in w if v != -1):
            missing = sorted(set(w) - set(g) - {-1})[:5]
            extra = sorted(set(g) - set(w) - {-1})[:5]
            return f"row {r}: index set differs (missing {missing}, extra {extra})"
    return ""


def _check_logits(got: torch.Tensor, want: torch.Tensor, bound: float) -> tuple[str, float]:
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}", float("inf")
    if got.dtype != torch.float32:
        return f"dtype {got.dtype}, expected float32", float("inf")
    want_nan, got_nan = torch.isnan(want), torch.isnan(got)
    if not torch.equal(want_nan, got_nan):
        return f"NaN placement differs at {int((want_nan != got_nan).sum())} positions", float("inf")
    got = got.double()
    want_inf, got_inf = torch.isneginf(want), torch.isneginf(got)
    if not torch.equal(want_inf, got_inf):
        return f"-inf placement differs at {int((want_inf != got_inf).sum())} positions", float("inf")
    finite = ~want_inf & ~want_nan
    if torch.isinf(got[finite]).any():
        return "+inf among finite values", float("inf")
    if not finite.any():
        return "", 0.0
    ref_norm = want[finite].norm().item()
    err = (got[finite] - want[finite]).norm().item() / max(ref_norm, 1e-300)
    return ("" if err <= bound else f"relative RMS error {err:.3g} > {bound:g}"), err


def _bytes_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape:
        return False
    return torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def _judge(case: Case, args: dict, backend: str, accumulation: str) -> tuple[str, float | None, float | None]:
    """Run the case; return (failure detail or "", error, bound)."""
    op = case.op
    ref_args = {k: _cpu(v) for k, v in args.items() if k not in ("out", "out_raw", "sorted")}
    if op == "translate":
        got = indexcache.translate(**args, backend=backend)
        if "out" in args and got.data_ptr() != args["out"].data_ptr():
            return "did not write into the given out", None, None
        want = reference.translate(**ref_args)
        return ("" if torch.equal(_cpu(got), want) else f"{int((_cpu(got) != want).sum())} slots differ"), None, None
    if op == "topk":
        got = _cpu(indexcache.topk(**args, backend=backend))
        return _check_topk(got, reference.topk(**ref_args), args.get("sorted", False)), None, None
    if op == "topk_translate":
        got = _cpu(indexcache.topk_translate(**args, backend=backend))
        want_phys, want_raw = reference.topk_translate(**ref_args)
        sort = args.get("sorted", False)
        if args.get("out_raw") is None:
            if sort:
                return _check_topk(got, want_phys, True), None, None
            # Order is unspecified: compare the physical sets row by row.
            sets_got, sets_want = _rows_as_sets(got), _rows_as_sets(want_phys)
            bad = [r for r, (a, b) in enumerate(zip(sets_got, sets_want, strict=True)) if a != b]
            return (f"rows {bad[:5]} differ" if bad else ""), None, None
        raw = _cpu(args["out_raw"])
        if detail := _check_topk(raw, want_raw, sort):
            return f"out_raw: {detail}", None, None
        again = reference.translate(raw, ref_args["page_table"], ref_args["lengths"], ref_args["page_size"],
                                    row_to_batch=ref_args.get("row_to_batch"))
        return ("" if torch.equal(got, again) else "out is not translate(out_raw)"), None, None
    if op in ("mqa_logits", "paged_mqa_logits"):
        kind = "bf16" if args["q"].dtype == torch.bfloat16 else "fp8"
        bound = BOUNDS[(kind, accumulation)]
        got = _cpu(getattr(indexcache, op)(**args, backend=backend))
        detail, err = _check_logits(got, getattr(reference, op)(**ref_args), bound)
        return detail, err, bound
    if op == "quantize_index_k":
        q, scale = indexcache.quantize_index_k(**args, backend=backend)
        want_q, want_scale = reference.quantize_index_k(**ref_args)
        if not torch.equal(_cpu(scale).nan_to_num(-1.0), want_scale.nan_to_num(-1.0)):  # scales are positive
            return "scales differ", None, None
        return ("" if _bytes_equal(_cpu(q), want_q) else "fp8 values differ"), None, None
    if op == "store_index_k":
        want = reference.store_index_k(**ref_args)
        indexcache.store_index_k(**args, backend=backend)
        return ("" if _bytes_equal(_cpu(args["k_cache"]), want) else "cache bytes differ"), None, None
    raise ValueError(f"op: unknown op {op!r}")


def native_fp8(backend: str) -> torch.dtype:
    """The fp8 format a backend computes in (its info's ``fp8_dtype``; e4m3fn when it names none)."""
    name = dispatch.get(backend).info().get("fp8_dtype", "torch.float8_e4m3fn")
    return getattr(torch, name.removeprefix("torch."))


def run_case(case: Case, backend: str, seed: int = 0) -> CaseResult:
    """Build the case on the backend's device, run it there through the public op, judge it."""
    avail = dispatch.availability(backend)
    accumulation = "tensor-core" if dispatch.get(backend).fp8_tensor_core and avail.mode == "GPU" else "fp32"
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(avail.device)
    args = case.build(gen, device, native_fp8(backend)) if case.native_fp8 else case.build(gen, device)
    start = time.perf_counter()
    try:
        detail, err, bound = _judge(case, args, backend, accumulation)
    except dispatch.BackendNotSupportedError as exc:
        return CaseResult(case.op, case.name, "declined", str(exc), seconds=time.perf_counter() - start)
    except Exception as exc:  # a crash is a failure of the backend, reported, not raised
        return CaseResult(case.op, case.name, "failed", f"{type(exc).__name__}: {exc}",
                          seconds=time.perf_counter() - start)
    status = "failed" if detail else "passed"
    return CaseResult(case.op, case.name, status, detail, err, bound, time.perf_counter() - start)
