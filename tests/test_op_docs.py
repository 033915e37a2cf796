"""The public ops' docstrings: one runnable example each (run here, so they stay true), and each op's
signature is its spec record's checks plus ``sm_budget`` (the budgeted ops) and ``backend``."""

import doctest
import inspect

import pytest

from indexcache.hal import library, ops
from indexcache.hal.specs import SPECS

EXAMPLES = {t.name.removeprefix("indexcache.hal.ops."): t for t in doctest.DocTestFinder().find(ops) if t.examples}


@pytest.mark.parametrize("op", list(SPECS))
def test_example_runs(op):
    test = EXAMPLES[op]
    for section in ("Parameters", "Raises", "Examples"):
        assert f"\n    {section}\n    ---" in test.docstring, f"{op}: no {section} section"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_every_example_is_an_op():
    assert set(EXAMPLES) == set(SPECS)


@pytest.mark.parametrize("op", list(SPECS))
def test_signature_is_the_checks_plus_backend(op):
    public = inspect.signature(getattr(ops, op)).parameters
    checks = inspect.signature(SPECS[op].check).parameters
    assert list(public) == [*checks, *(["sm_budget"] if op in library.BUDGETED_OPS else []), "backend"]
    for name, param in checks.items():
        assert (param.kind, param.default) == (public[name].kind, public[name].default), name
