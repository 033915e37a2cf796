"""The conformance suite: every case of the catalogue on every backend available in this process.

``INDEXCACHE_CONFORMANCE_BACKENDS=cuda,rocm`` restricts the backends (tox's interpreted envs set
it together with ``TRITON_INTERPRET=1``; conftest.py parametrizes ``backend``). A case a backend
declines is a skip with its reason; a decline without a reason fails. A backend that declines every selected case
shows only skips here, never a pass, and fails the run (conftest.py), as ``indexcache conformance`` does (nothing
was checked).
"""

import pytest

from indexcache.conformance.cases import CASES
from indexcache.conformance.check import run_case


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.op}:{c.name}")
def test_case(backend, case):
    result = run_case(case, backend)
    if result.status == "declined":
        pytest.skip(f"{backend} declines: {result.detail}")
    assert result.status == "passed", result.detail
