import pytest
import torch

from indexcache.hal import dispatch


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
