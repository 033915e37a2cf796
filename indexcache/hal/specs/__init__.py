"""One spec record per op (:class:`~indexcache.hal.specs.base.OpSpec`): its checks, float64 reference, judge
rule, conformance cases and benchmark definition (:class:`~indexcache.hal.specs.bench.BenchSpec`), each op in
its own module. Adding a case to an op touches that op's module; adding an op, its module and its name in
:data:`OP_NAMES` (docs/architecture.md, "Adding an op").

:data:`OP_NAMES` is the one list of the ops' names: every other one (the public ops, the package root, the
reference, the contract, the command's help) is derived from it or from :data:`SPECS`. This module is pure
Python, so the package root names the ops without importing torch; :data:`SPECS` loads the records (and torch)
at its first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from indexcache.hal.specs.base import OpSpec

    SPECS: dict[str, OpSpec]

# The ops, in catalogue order (docs/ops.md's); each one's record is ``SPEC`` in ``hal/specs/<name>.py``.
OP_NAMES = ("translate", "topk", "topk_translate", "mqa_logits", "paged_mqa_logits", "paged_topk_translate",
            "mqa_topk_translate", "quantize_index_k", "store_index_k", "gather_index_k", "hisparse_plan",
            "hisparse_swap_in")


def __getattr__(name: str):
    if name != "SPECS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    specs = {spec.name: spec for spec in (importlib.import_module(f"{__name__}.{op}").SPEC for op in OP_NAMES)}
    globals()["SPECS"] = specs
    return specs
