"""The float64 / int64 oracle every backend is judged against: short, obviously right, slow.

Each op's reference lives in its spec record (:mod:`indexcache.hal.specs`), next to its checks and judge
rule; ``reference.<op>`` is that function, for every op of the records. They run on the CPU (inputs are copied
there first), loop over rows where that makes the rule plain, and return int32 indices (-1 for an empty slot)
or float64 logits.
"""

from indexcache.hal.specs import SPECS

globals().update({op: spec.reference for op, spec in SPECS.items()})
__all__ = list(SPECS)
