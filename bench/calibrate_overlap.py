"""Time ``indexcache.tools.calibrate.overlap.overlap_matrix`` on a synthetic dump of DeepSeek-V3.2 size (CPU).

    python bench/calibrate_overlap.py                      # 61 layers x 4096 rows x k 2048
    python bench/calibrate_overlap.py --pool 65536         # harder: fresh picks from the whole context
    python bench/calibrate_overlap.py --rows 256 --write-dump /tmp/dump   # a dump for indexcache calibrate

Synthetic stack: layers come in groups of 4 that share a drifting base set (each group keeps 70 % of
the previous group's, each layer 90 % of its group's), drawn from ``--pool`` candidate tokens of a
``--context``-token sequence. Each row relabels the tokens with its own bijection (xor, then rotate),
so every row is different while every row's true overlap equals the base sets' overlap: the result
is checked against that exactly. The cost grows with the union of all layers' picks in a row, which
the output reports (as a multiple of k).
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import numpy as np

from indexcache.bench.timing import host_seconds
from indexcache.tools.calibrate.overlap import overlap_matrix, usable_cpus


def layer_sets(layers: int, k: int, pool: int, context: int, seed: int) -> np.ndarray:
    """``[layers, k]`` distinct token ids per layer, grouped and drifting as the module docstring says."""
    rng = np.random.default_rng(seed)
    candidates = rng.choice(context, pool, replace=False)

    def drift(tokens: np.ndarray, fraction: float) -> np.ndarray:
        kept = rng.choice(tokens, k - int(fraction * k), replace=False)
        fresh = rng.choice(np.setdiff1d(candidates, kept), k - len(kept), replace=False)
        return np.concatenate([kept, fresh])

    base = rng.choice(candidates, k, replace=False)
    sets = []
    for layer in range(layers):
        if layer and layer % 4 == 0:
            base = drift(base, 0.3)
        sets.append(drift(base, 0.1))
    return np.stack(sets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--context", type=int, default=1 << 16, help="tokens a row can pick from (power of 2)")
    parser.add_argument("--pool", type=int, default=8192, help="tokens any layer ever picks (default 4 k)")
    parser.add_argument("--threads", type=int, default=None, help="default: every CPU this process may use")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write-dump", metavar="DIR", help="also save the stack as layer_<id>.npz files there")
    args = parser.parse_args()
    if args.context & (args.context - 1):
        parser.error("--context must be a power of 2 (rows relabel tokens with xor)")

    sets = layer_sets(args.layers, args.k, min(args.pool, args.context), args.context, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    flip = rng.integers(0, args.context, (args.rows, 1), dtype=np.int32)
    shift = rng.integers(0, args.context, (args.rows, 1), dtype=np.int32)
    stack = [((s.astype(np.int32)[None, :] ^ flip) + shift) & (args.context - 1) for s in sets]
    if args.write_dump:
        Path(args.write_dump).mkdir(parents=True, exist_ok=True)
        for layer, indices in enumerate(stack):
            np.savez(Path(args.write_dump) / f"layer_{layer:03d}.npz", indices=indices)
    union = len(np.unique(sets))
    truth = np.array([[len(np.intersect1d(a, b)) / args.k for b in sets] for a in sets])

    threads = args.threads or usable_cpus()
    got, seconds, cpu = host_seconds(lambda: overlap_matrix(stack, threads=threads))
    error = float(np.abs(got - truth).max())
    adjacent = float(np.mean(np.diag(truth, 1)))
    print(
        f"overlap_matrix  {args.layers} layers x {args.rows} rows x k {args.k}, context {args.context}, "
        f"union {union / args.k:.1f} k a row, adjacent overlap {adjacent:.2f}"
    )
    print(
        f"  CPU ({platform.processor() or platform.machine()}, {threads} thread(s), "
        f"load {os.getloadavg()[0]:.1f}): {seconds:.2f} s wall, {cpu:.2f} s CPU time; max error {error:.1e}"
    )
    if error > 1e-9:
        raise SystemExit("overlap differs from the planted truth")


if __name__ == "__main__":
    main()
