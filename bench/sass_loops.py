"""The loops of a kernel's SASS for an NVIDIA target, on any machine (no GPU): what to read before spending device time.

    python bench/sass_loops.py --kernel paged_decode_sm90_kernel --where MXFP4=1 [--arch sm90] [--opcodes 12]
    python bench/sass_loops.py --kernel topk_sample_kernel --tuning topk.SAMPLE_ROUNDS=3 [--out loops.json]

Each build of the kernel that the cuda backend's compile specs declare for ``--arch`` (``--where NAME=VALUE`` keeps
those whose compile-time value matches; ``--tuning OP.KEY=VALUE`` overrides the tuning table first, as a race's
overrides would) is compiled as the cross-compile check compiles it (``crosscompile.build``: Triton's own ptxas, no
GPU), and its SASS (``cuobjdump``, through Triton) is read for loops: a branch back to an earlier label closes one.
Per loop: its instructions a pass (``NOP`` left out), the sum of their stall counts (the cycles a warp takes to issue
one pass when nothing makes it wait: a floor, not a timing), whether it holds another loop, and the count of the
opcode classes a kernel's time goes to (matrix, global and shared memory, barriers and waits, shuffles, byte
permutes, atomics). docs/fp4.md and docs/kernels.md count tile loops this way: instructions a pass times the passes a
warp makes, over the issue slots of the GPU, bound a kernel that is issue-bound from below.

Static counts of the Triton installed here (the GPU machine may run another: say which), never a speed.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Opcode classes (by the opcode's first dotted part).
CLASSES = {
    "matrix": ("HGMMA", "WGMMA", "HMMA", "IMMA", "QGMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA", "OMMA", "QMMA"),
    "global": ("LDG", "STG", "LD", "ST", "LDGSTS", "UBLKCP", "UTMALDG", "UTMASTG", "UTMAPF", "CCTL"),
    "shared": ("LDS", "STS", "LDSM", "STSM", "LDGDEPBAR"),
    "sync": ("BAR", "SYNCS", "WARPSYNC", "DEPBAR", "MEMBAR", "FENCE", "WARPGROUP", "ERRBAR"),
    "shuffle": ("SHFL",),
    "permute": ("PRMT",),
    "atomic": ("ATOM", "ATOMG", "ATOMS", "RED", "REDG"),
    "branch": ("BRA", "BRX", "CALL", "RET", "EXIT", "BSSY", "BSYNC"),
}
_LABEL = re.compile(r"^(\S+):\s*$")
_BRANCH = re.compile(r"\bBRA(?:\.\S+)?\s+`?\(?([A-Za-z_.$][\w.$]*)\)?")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


@dataclass
class Loop:
    """One loop of the SASS: the label it returns to, the instructions a pass and their stalls."""

    label: str
    first: int  # index of its first instruction
    last: int  # index of the branch that closes it
    instructions: int
    stall_cycles: int | None  # None when the listing carries no control codes
    inner: bool = True  # holds no other loop
    classes: dict[str, int] = field(default_factory=dict)
    opcodes: dict[str, int] = field(default_factory=dict)


def opcode(text: str) -> str:
    """The opcode of a SASS instruction: ``@!P0 BRA LBB3;`` → ``BRA``, ``IMAD.WIDE.U32 R2, ...`` → ``IMAD.WIDE.U32``."""
    return _PREDICATE.sub("", text.strip()).split(" ", 1)[0].rstrip(";")


def opcode_class(op: str) -> str | None:
    """The class of ``op`` in :data:`CLASSES` (by its first dotted part), or None."""
    head = op.split(".", 1)[0]
    return next((name for name, heads in CLASSES.items() if head in heads), None)


def parse(sass: str) -> tuple[list[tuple[int | None, str]], dict[str, int]]:
    """A SASS listing (Triton's: ``ctrl<TAB>instruction;`` lines and ``LABEL:`` lines; or bare instructions) as
    ``(instructions [(stall or None, text)], labels {name: index of the instruction it precedes})``."""
    code: list[tuple[int | None, str]] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        if not line.strip() or line.startswith("Function:"):
            continue
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(code)
            continue
        ctrl, tab, text = line.partition("\t")
        stall = None
        if tab and ctrl.count(":") == 4:
            stall = int(ctrl.rsplit(":", 1)[1], 16)
        else:
            text = line
        code.append((stall, text.strip()))
    return code, labels


def loops(sass: str) -> list[Loop]:
    """The loops of ``sass`` (a branch back to a label before it), outermost first where they share a start."""
    code, labels = parse(sass)
    found = []
    for at, (_, text) in enumerate(code):
        branch = _BRANCH.search(text)
        if branch and opcode(text).startswith("BRA") and labels.get(branch.group(1), at) < at:
            first = labels[branch.group(1)]  # (a branch to itself, after the kernel's last EXIT, is no loop)
            body = [(s, t) for s, t in code[first:at + 1] if opcode(t) != "NOP"]
            stalls = [s for s, _ in body]
            ops = Counter(opcode(t) for _, t in body)
            classes = Counter(c for op, n in ops.items() for c in [opcode_class(op)] * n if c)
            found.append(Loop(branch.group(1), first, at, len(body),
                              None if None in stalls else sum(stalls), classes=dict(classes),
                              opcodes=dict(ops.most_common())))
    for loop in found:
        loop.inner = not any(o is not loop and loop.first <= o.first and o.last <= loop.last for o in found)
    return sorted(found, key=lambda lp: (lp.first, -lp.last))


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def builds(kernel: str, arch: str, where: dict[str, Any], tuning_overrides: dict[str, dict[str, Any]]) -> list:
    """The compile specs of ``kernel`` for ``arch`` whose compile-time values match ``where``, under the cuda tuning
    table with ``tuning_overrides`` (per op entry)."""
    from indexcache.backends.cuda import tuning as cuda_tuning
    from indexcache.backends.triton.crosscompile import declared

    table = {op: dict(entry) for op, entry in cuda_tuning(arch).items()}
    for op, overrides in tuning_overrides.items():
        if op not in table:
            raise SystemExit(f"--tuning: no entry {op!r} in the cuda table (entries: {sorted(table)})")
        table[op].update(overrides)
    return [s for _, specs, _ in declared("cuda", arch, table) for s in specs or []
            if s.kernel == kernel and all(str(s.constexprs.get(n)) == str(v) for n, v in where.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", required=True, help="the kernel's name (e.g. paged_decode_sm90_kernel)")
    parser.add_argument("--arch", default="sm90", help="the NVIDIA target (default sm90)")
    parser.add_argument("--where", action="append", default=[], metavar="NAME=VALUE",
                        help="keep the builds whose compile-time NAME is VALUE (repeatable)")
    parser.add_argument("--tuning", action="append", default=[], metavar="OP.KEY=VALUE",
                        help="override the cuda tuning table's entry first (repeatable)")
    parser.add_argument("--opcodes", type=int, default=0, help="also list each inner loop's N most frequent opcodes")
    parser.add_argument("--out", default=None, help="write the loops as JSON here")
    args = parser.parse_args(argv)
    where = {n: _value(v) for n, _, v in (w.partition("=") for w in args.where)}
    overrides: dict[str, dict[str, Any]] = {}
    for item in args.tuning:
        key, _, value = item.partition("=")
        op, _, name = key.partition(".")
        if not (op and name and value):
            parser.error(f"--tuning: expected OP.KEY=VALUE, got {item!r}")
        overrides.setdefault(op, {})[name] = _value(value)
    from indexcache.backends.triton.crosscompile import build, gpu_target

    specs = builds(args.kernel, args.arch, where, overrides)
    if not specs:
        print(f"no build of {args.kernel} for {args.arch} matches {where or 'anything'}", file=sys.stderr)
        return 2
    import triton

    report = []
    for spec in specs:
        found = loops(build(spec, gpu_target("cuda", args.arch)).asm["sass"])
        config = {n: v for n, v in spec.constexprs.items() if isinstance(v, (bool, int, float, str))}
        report.append({"kernel": spec.kernel, "op": spec.op, "config": config, "loops": [asdict(lp) for lp in found]})
        print(f"{spec.kernel} ({spec.op}) {' '.join(f'{n}={v}' for n, v in config.items())}")
        for lp in found:
            stalls = "?" if lp.stall_cycles is None else lp.stall_cycles
            kinds = " ".join(f"{n} {c}" for n, c in sorted(lp.classes.items()))
            print(f"  {'inner' if lp.inner else 'outer'} loop at {lp.label}: {lp.instructions} instructions, "
                  f"{stalls} stall cycles a pass; {kinds}")
            if args.opcodes and lp.inner:
                print("    " + ", ".join(f"{op} {n}" for op, n in list(lp.opcodes.items())[:args.opcodes]))
    if args.out:
        Path(args.out).write_text(json.dumps({"arch": args.arch, "triton": triton.__version__, "builds": report},
                                             indent=1))
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
