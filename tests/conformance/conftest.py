"""The backends the conformance suite runs on: ``INDEXCACHE_CONFORMANCE_BACKENDS=cuda,rocm`` names them (tox's
backend envs set it), else every backend available in this process. A named backend that cannot run here stops the
run before any case, with one line saying why (exit 4), instead of failing every case with the same traceback. A
backend of which every selected case was declined (a skip) checked nothing: the run fails (exit 1), as
``indexcache conformance`` does, with a line naming it."""

import os
from pathlib import Path

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


_HERE = Path(__file__).parent
_BACKENDS = pytest.StashKey[set]()  # the backends of the cases collected here
_CHECKED = pytest.StashKey[set]()  # those of which a case passed or failed
_UNCHECKED = pytest.StashKey[list]()  # those of which none did, in a run that was otherwise green


def _backend_of(item) -> str | None:
    """The backend a conformance case collected here runs on (None: not such a case)."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("backend") if callspec is not None and item.path.parent == _HERE else None


def pytest_collection_finish(session):
    """The backends of the cases selected here (after ``-k`` and the like)."""
    session.config.stash[_BACKENDS] = {b for item in session.items if (b := _backend_of(item)) is not None}
    session.config.stash[_CHECKED] = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A backend checked something when a case of it passed or failed (a decline is a skip)."""
    report = (yield).get_result()
    backend = _backend_of(item)
    if backend is not None and ((report.passed and call.when == "call") or report.failed):
        item.config.stash[_CHECKED].add(backend)


def pytest_sessionfinish(session, exitstatus):
    """Fail a run that was green only because a backend declined every case it held."""
    unchecked = sorted(session.config.stash.get(_BACKENDS, set()) - session.config.stash.get(_CHECKED, set()))
    if unchecked and exitstatus == pytest.ExitCode.OK:
        session.config.stash[_UNCHECKED] = unchecked
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for name in config.stash.get(_UNCHECKED, []):
        terminalreporter.write_line(f"conformance: no case ran on backend {name}, nothing was checked: every case "
                                    "was declined (the skips say why)")
