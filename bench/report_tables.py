"""Markdown tables for BENCHMARKS.md from the JSON one ``ci/gpu.sh`` run wrote (committed under reports/gpu/).

    python bench/report_tables.py reports/gpu/<run>      # prints the tables of every result file found there
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from indexcache.bench.output import markdown_table


def _f(x, fmt: str = ".1f") -> str:
    return "—" if x is None else format(x, fmt)


def translate(path: Path) -> str:
    d = json.loads(path.read_text())
    ceil = d["ceilings"]
    copy, launch = ceil["copy_bandwidth"]["rate"] / 1e9, ceil["launch"]
    head = (f"{d['gpu']} · {d['date'][:10]} · commit {str(d['commit'])[:10]} · copy {copy:.0f} GB/s · empty Triton"
            f" launch {launch['eager_us']:.1f} µs eager, {launch['graph_us']:.2f} µs in a graph")
    rows = [[r["case"], r["backend"], _f(r["eager_us"]), _f(r["graph_us"]), _f(r["rate"], ".0f"),
             _f(100 * r["ceiling_fraction"], ".0f") + " %", _f(r["launch_ratio"], ".2f"),
             _f(r["speedup_vs_torch"], ".1f")] for r in d["results"]]
    header = ["case", "backend", "eager µs", "graph µs", "GB/s", "% copy", "eager × empty launch", "× torch"]
    return head + "\n\n" + markdown_table(header, rows)


def logits(path: Path) -> str:
    d = json.loads(path.read_text())
    c = d["ceilings"]
    head = (f"{d['gpu']} · {d['date'][:10]} · commit {str(d['commit'])[:10]} · Triton {d['triton']} · fp8 matmul "
            f"{c['fp8_tflops']:.0f} TFLOP/s, bf16 {c['bf16_tflops']:.0f} TFLOP/s, copy {c['copy_gbps']:.0f} GB/s")
    pre = [[r["case"], _f(r["ms"], ".3f"), _f(r["tflops"], ".0f"), _f(100 * r["fraction"], ".1f") + " %",
            _f(r["torch_ms"], ".1f"), _f(r["speedup"], ".1f")] for r in d["prefill"]]
    dec = [[r["case"], _f(r["ms"] * 1e3, ".0f"), _f(r.get("graph_ms", 0) * 1e3, ".0f"), _f(r["floor_ms"] * 1e3, ".0f"),
            _f(r["gbps"], ".0f"), _f(100 * r["fraction"], ".1f") + " %", _f(r["speedup"], ".1f")] for r in d["decode"]]
    return "\n\n".join([
        head,
        markdown_table(["prefill (mqa_logits)", "ms", "TFLOP/s (in-window)", "of matmul rate", "torch ms", "× torch"],
                       pre),
        markdown_table(["decode (paged_mqa_logits)", "eager µs", "graph µs", "floor µs", "GB/s (graph)", "of copy",
                        "× torch"], dec),
    ])


def topk(path: Path) -> str:
    d = json.loads(path.read_text())
    head = f"{d['gpu']} · {d['date'][:10]} · commit {str(d['commit'])[:10]} · Triton {d['triton']}; graph replays"
    rows = [[r["case"], _f(r["read_us"]), _f(r["torch_topk_us"]), _f(r["topk_us"]), _f(r["topk_translate_us"]),
             _f(r["torch_backend_us"], ".0f"), _f(r["x_read"], ".2f"), _f(r["speedup_vs_torch_topk"], ".2f"),
             _f(r["translate_over_topk"], ".2f")] for r in d["timings"]]
    return head + "\n\n" + markdown_table(["case", "read once µs", "torch.topk µs", "topk µs", "topk_translate µs",
                                          "torch backend µs", "× read", "× faster than torch.topk", "translate / topk"],
                                         rows)


def main(run: str) -> None:
    root = Path(run)
    for name, fn in (("bench-translate.json", translate), ("logits.json", logits), ("topk.json", topk)):
        if (root / name).exists():
            print(f"<!-- {root / name} -->\n{fn(root / name)}\n")


if __name__ == "__main__":
    main(sys.argv[1])
