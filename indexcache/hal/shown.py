"""Ints, sizes and strides as the ops' error messages show them, the same in eager mode and while Dynamo traces.

Under ``torch.compile`` with dynamic shapes (``dynamic=True``, ``mark_dynamic`` or automatic dynamic) a tensor's sizes
and strides and the int arguments are symbolic while Dynamo traces the spec checks, and Dynamo cannot format a
symbolic int (nor a float argument, symbolic too): with ``fullgraph=True`` a refused call reported "Failed to trace
builtin operator" (or "BUILD_STRING type error") in place of the check's message. ``operator.index`` (``float``) gives
Dynamo the value (a guard on it, moot: the frame raises).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable


def shown(value) -> int:
    """An int (an argument, a size or a stride) as an error message shows it: its value."""
    return operator.index(value)


def dims(sizes: Iterable) -> str:
    """``"[3, 4]"``: a shape or strides as an error message shows them (``list(t.shape)`` in eager mode)."""
    return "[" + ", ".join([str(shown(s)) for s in sizes]) + "]"


def given(value):
    """An argument that is not what a check expected, as its message shows it (``{given(value)!r}``): a float as its
    value (symbolic while Dynamo traces with dynamic shapes), anything else as it came."""
    return float(value) if isinstance(value, float) else value
