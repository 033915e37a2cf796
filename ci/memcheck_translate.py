"""Adversarial page-translation cases, every backend against ``indexcache.hal.reference.translate``.

On a GPU, under the memory checker (every tensor is its own device allocation, so an overrun of
any input or output leaves its allocation)::

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 ci/memcheck_translate.py

On a CPU, ``TRITON_INTERPRET=1 python ci/memcheck_translate.py`` runs the same cases with the
Triton backends interpreted (the results are checked; there is no memory checker). Exits 1 on any
mismatch, write outside ``out`` or error.
"""

import os

# Before torch starts CUDA: no caching allocator, so each tensor is a separate cudaMalloc that memcheck bounds.
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import torch  # noqa: E402

import indexcache  # noqa: E402
from indexcache.hal import dispatch, reference  # noqa: E402

I32_MAX, I32_MIN = 2**31 - 1, -(2**31)
SENTINEL = -9  # fills the parent of a strided ``out``: slots outside the view must keep it
PAGE_SIZES = (1, 3, 64)
Case = dict  # raw, page_table, seq_lens, page_size, row_to_batch (CPU tensors); "strided" makes views on the device


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _random(gen: torch.Generator, rows: int, k: int, batches: int, pages: int, page_size: int) -> Case:
    """Everything at once: raw, seq_lens, table entries and row_to_batch drawn around every bound."""
    span = pages * page_size
    return dict(
        raw=torch.randint(-3, span + page_size + 3, (rows, k), generator=gen, dtype=torch.int32),
        page_table=torch.randint(-2, 1 << 20, (batches, pages), generator=gen, dtype=torch.int32),
        seq_lens=torch.randint(-2, span + 5, (rows,), generator=gen, dtype=torch.int32),
        page_size=page_size,
        row_to_batch=torch.randint(-2, batches + 2, (rows,), generator=gen, dtype=torch.int32),
    )


def _extreme_raw(page_size: int, pages: int) -> torch.Tensor:
    span = pages * page_size
    return _i32([I32_MAX, I32_MIN, I32_MIN + 1, -1, -2, 0, 1, page_size - 1, page_size, span - 1, span, span + 1,
                 span * 2, 1 << 30, I32_MAX - page_size, 4, 5, 6])


def cases(gen: torch.Generator) -> Iterator[tuple[str, Case]]:
    """(name, case) pairs; every case is small, so the reference stays fast."""
    batches, pages = 5, 6
    for ps in PAGE_SIZES:
        table = torch.randint(0, 1000, (batches, pages), generator=gen, dtype=torch.int32)
        raw = _extreme_raw(ps, pages).repeat(7, 3)
        rows = raw.shape[0]
        # Rows see: everything, exactly the table, 5 tokens, nothing, a negative length, the most negative one.
        seq = _i32([I32_MAX, pages * ps, 5, 0, -5, I32_MIN, I32_MAX])
        yield f"page {ps}: extreme raw values, extreme seq_lens", dict(
            raw=raw, page_table=table, seq_lens=seq, page_size=ps, row_to_batch=None)
        huge = (I32_MAX // ps) - 1  # the largest entry whose slots all fit in int32
        bad = _i32([[-1, I32_MIN, 0, huge, -7, 3]] * batches)
        yield f"page {ps}: negative and huge table entries", dict(
            raw=raw, page_table=bad, seq_lens=torch.full((rows,), I32_MAX, dtype=torch.int32), page_size=ps,
            row_to_batch=None)
        r2b = _i32([-1, batches, I32_MAX, I32_MIN, 0, batches - 1, 2])
        yield f"page {ps}: row_to_batch out of range", dict(
            raw=raw, page_table=table, seq_lens=torch.full((rows,), I32_MAX, dtype=torch.int32), page_size=ps,
            row_to_batch=r2b)
        yield f"page {ps}: random around every bound, 37 x 1500", _random(gen, 37, 1500, batches, pages, ps)
        yield f"page {ps}: non-contiguous inputs and out", dict(
            _random(gen, 29, 300, batches, pages, ps), strided=True)
    for k, rows in ((0, 4), (7, 0), (0, 0)):
        yield f"k = {k}, rows = {rows}", dict(
            raw=torch.zeros((rows, k), dtype=torch.int32), page_table=torch.zeros((2, 3), dtype=torch.int32),
            seq_lens=torch.full((rows,), 10, dtype=torch.int32), page_size=3, row_to_batch=None)
    for shape in ((batches, 0), (0, pages)):
        yield f"empty table {list(shape)}", dict(
            raw=_extreme_raw(3, pages).repeat(3, 1), page_table=torch.zeros(shape, dtype=torch.int32),
            seq_lens=torch.full((3,), I32_MAX, dtype=torch.int32), page_size=3,
            row_to_batch=_i32([0, 1, -1]))


def _strided(t: torch.Tensor, device: torch.device, fill: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same values as a non-contiguous view on ``device`` (2-D: transposed with a row gap, 1-D: stride 3):
    ``(view, parent, mask of the parent's slots outside the view)``."""
    if t.dim() == 1:
        parent = torch.full((t.shape[0], 3), fill, dtype=t.dtype, device=device)
        view = parent[:, 1]
    else:
        parent = torch.full((2 * t.shape[1] + 1, t.shape[0]), fill, dtype=t.dtype, device=device)
        view = parent[1::2].t()
    view.copy_(t)
    outside = torch.ones(parent.shape, dtype=torch.bool)
    outside[(slice(None), 1) if t.dim() == 1 else slice(1, None, 2)] = False
    return view, parent, outside


def run_case(case: Case, backend: str, device: torch.device) -> str | None:
    """Translate on ``backend``; None when it equals the reference and wrote only inside ``out``, else why."""
    strided = case.get("strided", False)

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else _strided(t, device)[0] if strided else t.to(device)

    raw, table, seq, r2b = (move(case[n]) for n in ("raw", "page_table", "seq_lens", "row_to_batch"))
    poisoned = torch.full(case["raw"].shape, SENTINEL, dtype=torch.int32)
    out, parent, outside = _strided(poisoned, device, SENTINEL) if strided else (poisoned.to(device), None, None)
    if strided and out.is_contiguous():
        return "the strided case built a contiguous out"
    got = indexcache.translate(raw, table, seq, case["page_size"], row_to_batch=r2b, out=out, backend=backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    want = reference.translate(case["raw"], case["page_table"], case["seq_lens"], case["page_size"],
                               row_to_batch=case["row_to_batch"])
    if got is not out:
        return "did not return the given out"
    if strided and not bool((parent.cpu()[outside] == SENTINEL).all()):
        return "wrote outside the strided out view"
    bad = (got.cpu() != want).nonzero()
    if len(bad):
        r, j = bad[0].tolist()
        return (f"{len(bad)} slots differ from the reference, first at [{r}, {j}]: raw {int(case['raw'][r, j])}, "
                f"got {int(got[r, j])}, want {int(want[r, j])}")
    return None


def main() -> int:
    gpu = torch.cuda.is_available()
    backends = [n for n in dispatch.available_backends() if "translate" in dispatch.ops_of(n)]
    print(f"device: {torch.cuda.get_device_name() if gpu else 'CPU'}; backends: "
          + ", ".join(f"{n} ({dispatch.availability(n).mode})" for n in backends))
    failures = 0
    all_cases = list(cases(torch.Generator().manual_seed(2024)))
    for backend in backends:
        device = torch.device(dispatch.availability(backend).device)
        for name, case in all_cases:
            try:
                why = run_case(case, backend, device)
            except Exception as exc:  # report and go on: the next cases may still pass
                why = f"raised {type(exc).__name__}: {exc}"
            failures += why is not None
            print(f"{'FAIL' if why else 'ok  '} {backend:<6} {name}" + (f": {why}" if why else ""))
    total = len(backends) * len(all_cases)
    print(f"{total - failures}/{total} translate cases equal the reference on {', '.join(backends)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
