"""The Triton launcher's specialization key is never coarser than Triton's own, and a wrong call is refused.

The direct launch itself needs a GPU (``ci/gpu.sh`` runs the conformance suite through it); here the key is
compared with Triton's ``native_specialize_impl`` on CPU values.
"""

from __future__ import annotations

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from indexcache.backends.triton.launcher import Launcher, launch_key_options  # noqa: E402


def _kernel(x_ptr, n, FLAG: triton.language.constexpr):
    pass


def _launcher() -> Launcher:
    return Launcher(JITFunction(_kernel))


def _values() -> list:
    base = torch.zeros(64, dtype=torch.int32)
    ints = [0, 1, 2, 15, 16, 17, 32, -16, -1, 2**31 - 16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 16, 2**40,
            2**63 - 16, 2**63, 2**64 - 16]
    tensors = [base, base[1:], base[4:], torch.zeros(8, dtype=torch.float32), torch.zeros(8, dtype=torch.uint8)[1:],
               torch.zeros(8, dtype=torch.bfloat16)]
    return [*ints, *tensors, None, True, False, 1.5]


def test_key_separates_what_triton_specializes():
    launcher = _launcher()
    rule = lambda t: t.data_ptr() % 16 == 0  # noqa: E731  (NVIDIA's rule, BaseBackend's)
    values = _values()
    ours = [launcher._classes((v, 0, True), rule)[0] for v in values]
    theirs = [native_specialize_impl(BaseBackend, v, False, True, True) for v in values]
    for (a, ka, ta), (b, kb, tb) in itertools.combinations(zip(values, ours, theirs, strict=True), 2):
        if ka == kb:
            assert ta == tb, f"{a!r} and {b!r} share the key {ka!r} but Triton specializes them as {ta} and {tb}"


def test_constexpr_values_are_part_of_the_key():
    launcher = _launcher()
    rule = lambda t: True  # noqa: E731
    assert launcher._classes((None, 3, 4), rule) != launcher._classes((None, 3, 5), rule)


def test_wrong_arguments_name_what_is_missing_and_unexpected():
    launcher = _launcher()
    with pytest.raises(TypeError, match=r"_kernel: expected 3 arguments, missing \['FLAG'\], unexpected \['FLAGG'\]"):
        launcher((1,), launch_key_options({"num_warps": 4}), None, 1, FLAGG=True)


def test_launch_options_are_ordered_and_hashable():
    options = launch_key_options({"num_warps": 4, "num_stages": 2})
    assert options == (("num_stages", 2), ("num_warps", 4))
    assert hash(options) == hash(launch_key_options({"num_stages": 2, "num_warps": 4}))
