"""The case catalogue: every op on the same generated inputs, edge cases included.

The cases live in the ops' spec records (:mod:`indexcache.hal.specs`); this is their list, op by op in
catalogue order. A case builds the public op's keyword arguments on a device from a seeded generator, so
every backend sees identical inputs. Tensors are made on the CPU and moved; views that must stay
non-contiguous are taken after the move.
"""

from __future__ import annotations

from indexcache.hal.specs import SPECS
from indexcache.hal.specs.base import Case

__all__ = ["CASES", "Case", "cases_for"]

CASES: list[Case] = [case for spec in SPECS.values() for case in spec.cases]


def cases_for(op: str | None = None) -> list[Case]:
    """The catalogue, or the cases of one op."""
    return [c for c in CASES if op is None or c.op == op]
