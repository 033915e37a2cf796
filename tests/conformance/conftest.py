"""The backends the conformance suite runs on: ``INDEXCACHE_CONFORMANCE_BACKENDS=cuda,rocm`` names them (tox's
backend envs set it), else every backend available in this process. A named backend that cannot run here stops the
run before any case, with one line saying why (exit 4), instead of failing every case with the same traceback."""

import os

import pytest

from indexcache.hal import dispatch

ENV_VAR = "INDEXCACHE_CONFORMANCE_BACKENDS"
# The tox env that runs a Triton backend's kernels interpreted on a machine without its GPU.
INTERPRETED_ENV = {"cuda": "cuda-interpret", "rocm": "rocm-interpret"}


def conformance_backends() -> list[str]:
    wanted = os.environ.get(ENV_VAR)
    if wanted:
        return [name.strip() for name in wanted.split(",") if name.strip()]
    return dispatch.available_backends()


def pytest_configure(config):
    for name in conformance_backends():
        try:
            avail = dispatch.availability(name)
        except dispatch.UnknownBackendError as exc:
            raise pytest.UsageError(f"{ENV_VAR}: {exc}") from None
        if not avail.available:
            hint = f" (tox -e {INTERPRETED_ENV[name]} does)" if name in INTERPRETED_ENV else ""
            raise pytest.UsageError(f"{ENV_VAR} names {name}, which cannot run here: {avail.reason}{hint}")


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", conformance_backends())
