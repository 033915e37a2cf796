"""The conformance suite: every case of the catalogue on every backend available in this process.

``INDEXCACHE_CONFORMANCE_BACKENDS=cuda,rocm`` restricts the backends (tox's interpreted envs set
it together with ``TRITON_INTERPRET=1``). A case a backend declines is a skip with its reason.
"""

import os

import pytest

from indexcache.conformance.cases import CASES
from indexcache.conformance.check import run_case
from indexcache.hal import dispatch


def _backends() -> list[str]:
    wanted = os.environ.get("INDEXCACHE_CONFORMANCE_BACKENDS")
    if wanted:
        return [name.strip() for name in wanted.split(",") if name.strip()]
    return dispatch.available_backends()


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.op}:{c.name}")
def test_case(backend, case):
    avail = dispatch.availability(backend)
    assert avail.available, f"backend {backend} is not available: {avail.reason}"
    result = run_case(case, backend)
    if result.status == "declined":
        pytest.skip(f"{backend} declines: {result.detail}")
    assert result.status == "passed", result.detail
