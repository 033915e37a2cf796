import os

import pytest
import torch

from indexcache.hal import dispatch

# Modules that run Triton kernels through the interpreter. Triton picks interpreter mode when a kernel is
# defined (module import), so they need TRITON_INTERPRET=1 from the start of the process; tox's
# kernels-interpret env runs them so. Elsewhere they are skipped with that reason.
INTERPRETED_MODULES = ("test_triton_",)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="runs Triton interpreted: needs TRITON_INTERPRET=1 from process start "
                                   "(tox -e kernels-interpret)")
    for item in items:
        if item.module.__name__.rpartition(".")[2].startswith(INTERPRETED_MODULES):
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One torch thread for the test: on two busy shared cores it is many times faster than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """Dispatch with no cached probes or choice; restored afterwards."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch.reset()
    yield dispatch
    dispatch.reset()


@pytest.fixture(scope="module")
def interpreted():
    """For a module's Triton kernel tests: TRITON_INTERPRET=1 before the backends are probed, probes forgotten
    afterwards (modules use it with ``pytest.mark.usefixtures("interpreted")``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv(dispatch.ENV_VAR, raising=False)
        dispatch.reset()
        yield
    dispatch.reset()
