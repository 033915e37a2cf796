"""The Triton kernels' own tests, run interpreted on the CPU (tox -e kernels-interpret runs this folder).

Triton picks interpreter mode when a kernel is defined (module import), so these modules need TRITON_INTERPRET=1
from the start of the process. Without it every test here is skipped with that reason; a test module that needs
the interpreter belongs in this folder, and tests/test_tox_envs.py checks that some tox env runs every test file."""

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="runs Triton interpreted: needs TRITON_INTERPRET=1 from process start "
                                   "(tox -e kernels-interpret)")
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(skip)
