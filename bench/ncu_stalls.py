"""Where a kernel's warps wait, from Nsight Compute's source page: read on any machine after a GPU run.

    # on the GPU machine (clocks left alone, as docs/kernels.md asks):
    ncu --clock-control none --section WarpStateStats --section SourceCounters -o rep python3 script.py
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    # here:
    python bench/ncu_stalls.py rep.csv [--kernel NAME] [--top 20] [--out stalls.json]

For each profiled kernel of the CSV (or those whose name holds ``--kernel``): its warp-state samples, the share of
each stall reason, the code grouped by how many times it ran (an instruction of a loop's body runs once a warp a
pass, so a tile loop, a row's code and a kernel's prologue fall in groups of their own), and the instructions holding
the most samples with their main reasons. Shares are of the kernel's samples, warps that only wait (a warp group's
idle warps at a barrier) included: read a group's own reasons. docs/fp4.md, "On the H100", and docs/kernels.md, "The
halves apart", were read this way. Counts of one sampled run, not a timing.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
_KERNEL = '"Kernel Name",'


def kernels(text: str) -> list[tuple[str, list[dict[str, str]]]]:
    """``(kernel name, rows)`` of each kernel in an ncu source-page CSV (``--page source --csv``): a ``"Kernel Name"``
    line, then a header and one row an instruction."""
    found = []
    for part in text.split(_KERNEL)[1:]:
        first, _, body = part.partition("\n")
        name = next(csv.reader([first]))[0]
        rows = [r for r in csv.DictReader(io.StringIO(body)) if r.get("Address")]
        found.append((name, rows))
    return found


def _number(text: str | None) -> float:
    return float(text.replace(",", "")) if text else 0.0


def reasons(row: dict[str, str]) -> Counter:
    """A row's samples by stall reason (the ``stall_*`` columns, their not-issued twins left out)."""
    return Counter({k[len("stall_"):]: _number(v) for k, v in row.items()
                    if k.startswith("stall_") and "Not Issued" not in k and _number(v)})


def summary(rows: list[dict[str, str]], top: int = 20, groups: int = 8) -> dict[str, Any]:
    """One kernel's samples: ``total``, ``reasons`` (share of each), ``groups`` (the code by times it ran, the most
    sampled first: ``executed``, ``instructions``, ``share``, its ``reasons``) and ``top`` (the ``top`` instructions
    by samples: ``address``, ``source``, ``executed``, ``share``, its three main ``reasons``)."""
    total = sum(_number(r.get(SAMPLES)) for r in rows) or 1.0
    by_reason: Counter = Counter()
    by_count: dict[int, Counter] = defaultdict(Counter)
    sizes: Counter = Counter()
    for r in rows:
        mine = reasons(r)
        by_reason.update(mine)
        executed = int(_number(r.get(EXECUTED)))
        by_count[executed].update(mine)
        sizes[executed] += 1

    def shares(c: Counter, n: int | None = None) -> dict[str, float]:
        return {k: round(v / total, 4) for k, v in c.most_common(n)}

    ranked = sorted(by_count.items(), key=lambda kv: -sum(kv[1].values()))[:groups]
    hot = sorted(rows, key=lambda r: -_number(r.get(SAMPLES)))[:top]
    return {"total": total, "reasons": shares(by_reason),
            "groups": [{"executed": n, "instructions": sizes[n], "share": round(sum(c.values()) / total, 4),
                        "reasons": shares(c, 6)} for n, c in ranked],
            "top": [{"address": r["Address"], "source": " ".join(r.get("Source", "").split()),
                     "executed": int(_number(r.get(EXECUTED))), "share": round(_number(r.get(SAMPLES)) / total, 4),
                     "reasons": shares(reasons(r), 3)} for r in hot]}


def _line(shares: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in shares.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu's source page as CSV (ncu -i REP --page source --csv --print-source sass)")
    parser.add_argument("--kernel", default="", help="only kernels whose name holds this")
    parser.add_argument("--top", type=int, default=20, help="instructions listed a kernel (default 20)")
    parser.add_argument("--out", default=None, help="write the summaries as JSON here")
    args = parser.parse_args(argv)
    found = [(name, rows) for name, rows in kernels(Path(args.csv).read_text()) if args.kernel in name]
    if not found:
        print(f"no kernel{' named ' + repr(args.kernel) if args.kernel else ''} in {args.csv}", file=sys.stderr)
        return 2
    report = []
    for i, (name, rows) in enumerate(found):
        s = summary(rows, args.top)
        report.append({"kernel": name, **s})
        print(f"[{i}] {name[:100]}: {len(rows)} instructions, {s['total']:.0f} samples")
        print(f"    reasons: {_line(s['reasons'])}")
        for g in s["groups"]:
            print(f"    ran {g['executed']:>9d} times: {g['instructions']:5d} instructions, {g['share']:.3f} of the "
                  f"samples: {_line(g['reasons'])}")
        for t in s["top"]:
            print(f"    {t['share']:.3f}  x{t['executed']:<9d} {t['source'][:64]:64s} {_line(t['reasons'])}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
