import pytest

from indexcache import dispatch


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """Dispatch with no cached probes or choice; restored afterwards."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch.reset()
    yield dispatch
    dispatch.reset()
