"""The Triton launcher's specialization key is never coarser than Triton's own, and a wrong call is refused.

The direct launch itself needs a GPU (``ci/gpu.sh`` runs the conformance suite through it); here the key is
compared with Triton's ``native_specialize_impl`` on CPU values.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from indexcache.backends.triton import launcher as launcher_module  # noqa: E402
from indexcache.backends.triton.launcher import Launcher, launch_key_options  # noqa: E402


def _kernel(x_ptr, n, FLAG: triton.language.constexpr):
    pass


def _launcher(**decorator) -> Launcher:
    return Launcher(JITFunction(_kernel, **decorator))


def _rule(t, align):  # NVIDIA's tensor rule, BaseBackend's
    return align and t.data_ptr() % 16 == 0


def _values() -> list:
    base = torch.zeros(64, dtype=torch.int32)
    ints = [0, 1, 2, 15, 16, 17, 32, -16, -1, 2**31 - 16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 16, 2**40,
            2**63 - 16, 2**63, 2**64 - 16]
    tensors = [base, base[1:], base[4:], torch.zeros(8, dtype=torch.float32), torch.zeros(8, dtype=torch.uint8)[1:],
               torch.zeros(8, dtype=torch.bfloat16)]
    return [*ints, *tensors, *_descriptors(), None, True, False, 1.5]


def _descriptors() -> list:
    """Gluon host tensor descriptors (TMA) of several dtypes, block shapes and shared layouts."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    found = []
    for dtype, gl_dtype in ((torch.float8_e4m3fn, gl.float8e4nv), (torch.float32, gl.float32)):
        x = torch.zeros(256, 128, dtype=dtype)
        for block in ([64, 128], [32, 128], [64, 64]):
            for layout in (gl.NVMMASharedLayout.get_default_for(block, gl_dtype),
                           gl.NVMMASharedLayout(0, gl_dtype.primitive_bitwidth)):
                found.append(TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout))
    return found


@pytest.mark.parametrize(("decorator", "specialize", "align"), [
    ({}, True, True),
    ({"do_not_specialize": ["x_ptr", "n"]}, False, True),
    ({"do_not_specialize_on_alignment": ["x_ptr"]}, True, False),
])
def test_key_separates_what_triton_specializes(decorator, specialize, align):
    launcher = _launcher(**decorator)
    values = _values()
    for position in (0, 1):  # the pointer's and the int's parameter: each with its own rule
        ours = [launcher._classes((v, 0, True)[:position] + (v,) + (0, True)[position:], _rule)[position]
                for v in values]
        theirs = [native_specialize_impl(BaseBackend, v, False, specialize, align) for v in values]
        for (a, ka, ta), (b, kb, tb) in itertools.combinations(zip(values, ours, theirs, strict=True), 2):
            if ka == kb:
                assert ta == tb, f"{a!r} and {b!r} share the key {ka!r} but Triton specializes them as {ta} and {tb}"


def test_an_unspecialized_parameter_keeps_only_its_type():
    """``do_not_specialize``: 1, 16 and 17 are one variant (the launcher's key as Triton's); a pointer without its
    alignment, aligned or not, is one too."""
    plain, free = _launcher(), _launcher(do_not_specialize=["n"], do_not_specialize_on_alignment=["x_ptr"])
    x = torch.zeros(64, dtype=torch.int32)
    for launcher, variants in ((plain, 3), (free, 1)):
        keys = {tuple(launcher._classes((x, n, True), _rule)) for n in (1, 16, 17)}
        assert len(keys) == variants
    assert free._classes((x, 5, True), _rule) == free._classes((x[1:], 5, True), _rule)
    assert plain._classes((x, 5, True), _rule) != plain._classes((x[1:], 5, True), _rule)
    assert free._classes((x, 5, True), _rule) != free._classes((x, 2**40, True), _rule)  # the width stays


def test_constexpr_values_are_part_of_the_key():
    launcher = _launcher()
    assert launcher._classes((None, 3, 4), _rule) != launcher._classes((None, 3, 5), _rule)


def test_wrong_arguments_name_what_is_missing_and_unexpected():
    launcher = _launcher()
    with pytest.raises(TypeError, match=r"_kernel: expected 3 arguments, missing \['FLAG'\], unexpected \['FLAGG'\]"):
        launcher((1,), launch_key_options({"num_warps": 4}), None, 1, FLAGG=True)


def test_launch_options_are_ordered_and_hashable():
    options = launch_key_options({"num_warps": 4, "num_stages": 2})
    assert options == (("num_stages", 2), ("num_warps", 4))
    assert hash(options) == hash(launch_key_options({"num_stages": 2, "num_warps": 4}))


class _Compiled:
    """A stand-in for Triton's compiled kernel: records what its launcher is called with."""

    def __init__(self, calls: list, backend: str = "cuda"):
        self.function, self.packed_metadata, self.calls = "function", "metadata", calls
        # The decode kernel at next_n 1 with Triton 3.6 on sm90: 96 registers, 34056 bytes of shared memory.
        self.n_regs, self.metadata = 96, SimpleNamespace(target=SimpleNamespace(backend=backend), shared=34056,
                                                         num_warps=4)

    def run(self, *args):
        self.calls.append(("direct", args))

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid}


class _Jit:
    """A stand-in for the JITFunction behind a Launcher: Triton's own launch path, recorded."""

    def __init__(self):
        self.calls: list = []

    def __getitem__(self, grid):
        def launch(*args, **named):
            self.calls.append(("triton", grid, args, named))
            return _Compiled(self.calls)
        return launch

    def warmup(self, *args, grid, **named):
        self.calls.append(("warmup", grid, args, named))
        return _Compiled(self.calls)


def _fast_launcher(monkeypatch) -> tuple[Launcher, _Jit]:
    """A Launcher whose Triton side is recorded: device 0, stream 77, NVIDIA's alignment rule."""
    launcher = _launcher()
    jit = _Jit()
    monkeypatch.setattr(launcher, "fn", jit)
    monkeypatch.setattr(launcher, "_driver", (lambda: 0, lambda device: 77, _rule))
    return launcher, jit


def test_the_first_call_of_a_specialization_goes_through_triton_then_direct(monkeypatch):
    launcher, jit = _fast_launcher(monkeypatch)
    opts = launch_key_options({"num_warps": 4})
    x = torch.zeros(64, dtype=torch.int32)
    launcher((2,), opts, x, 32, FLAG=True)
    launcher((3, 2), opts, x, 48, FLAG=True)  # 48: still a multiple of 16, same specialization
    assert [c[0] for c in jit.calls] == ["triton", "direct"]
    assert jit.calls[0][1:] == ((2,), (x, 32), {"FLAG": True, "num_warps": 4})
    assert jit.calls[1][1] == (3, 2, 1, 77, "function", "metadata", None, None, None, x, 48, True)
    launcher((2,), opts, x[1:], 48, FLAG=True)  # misaligned: another specialization
    launcher((2,), opts, x, 17, FLAG=True)  # not a multiple of 16
    launcher((2,), opts, x, 48, FLAG=False)  # another constexpr
    launcher((2,), launch_key_options({"num_warps": 8}), x, 48, FLAG=True)  # other options
    assert [c[0] for c in jit.calls[2:]] == ["triton"] * 4


def test_a_bound_launch_holds_addresses_and_launches_directly(monkeypatch):
    launcher, jit = _fast_launcher(monkeypatch)
    opts = launch_key_options({"num_warps": 4})
    x = torch.zeros(64, dtype=torch.int32)
    launch = launcher.bind((5,), opts, x, 32, FLAG=True)
    assert [c[0] for c in jit.calls] == ["warmup"]  # compiled, nothing launched
    launch()
    launch()
    assert jit.calls[1] == jit.calls[2] == ("direct", (5, 1, 1, 77, "function", "metadata", None, None, None,
                                                       x.data_ptr(), 32, True))
    launcher((5,), opts, x, 32, FLAG=True)  # the bound specialization serves plain calls too
    assert jit.calls[3][0] == "direct"


def test_resident_programs_come_from_the_compiled_kernel(monkeypatch):
    launcher, jit = _fast_launcher(monkeypatch)
    asked = []
    monkeypatch.setattr(launcher_module, "sm_limits", lambda device: asked.append(device) or (65536, 228 * 1024, 2048))
    opts = launch_key_options({"num_warps": 4})  # an H200's SM above
    x = torch.zeros(64, dtype=torch.int32)
    assert launcher.resident(opts, x, 32, FLAG=True) == 5  # 96 registers: 5 four-warp programs
    assert launcher.resident(opts, x, 48, FLAG=True) == 5  # the same specialization: compiled once, answered once
    assert [c[0] for c in jit.calls] == ["warmup"] and asked == [0]
    launcher((7,), opts, x, 32, FLAG=True)  # and launched directly afterwards
    assert [c[0] for c in jit.calls] == ["warmup", "direct"]
    monkeypatch.setattr(jit, "warmup", lambda *args, grid, **named: _Compiled(jit.calls, backend="hip"))
    assert launcher.resident(opts, x, 17, FLAG=True) is None  # AMD: the tuning table decides


def test_a_loaded_specialization_launches_directly_at_its_first_call(monkeypatch):
    """What ``indexcache.warmup`` loads (from meta tensors: only dtypes and addresses count) is kept under the key of
    the real calls, whose first launch then skips Triton's own launch path."""
    launcher, jit = _fast_launcher(monkeypatch)
    opts = launch_key_options({"num_warps": 4})
    launcher.load(opts, torch.empty(64, dtype=torch.int32, device="meta"), 32, FLAG=True)
    assert [c[0] for c in jit.calls] == ["warmup"]  # compiled or taken from the cache, nothing launched
    x = torch.zeros(64, dtype=torch.int32)
    launcher((3,), opts, x, 48, FLAG=True)
    assert [c[0] for c in jit.calls] == ["warmup", "direct"]
    launcher((3,), opts, x, 17, FLAG=True)  # a specialization not loaded: through Triton
    assert jit.calls[-1][0] == "triton"


def test_a_launch_hook_sends_every_call_through_triton(monkeypatch):
    from triton import knobs

    launcher, jit = _fast_launcher(monkeypatch)
    opts = launch_key_options({"num_warps": 4})
    x = torch.zeros(64, dtype=torch.int32)
    launcher((1,), opts, x, 32, FLAG=True)
    launch = launcher.bind((1,), opts, x, 32, FLAG=True)
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        launcher((1,), opts, x, 32, FLAG=True)
        launch()
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert jit.calls[1][0] == "triton"
    kind, args = jit.calls[2]
    assert kind == "direct" and args[6] == {"grid": (1,)} and args[7] is knobs.runtime.launch_enter_hook


def test_host_launch_arithmetic_equals_tritons():
    from indexcache.backends.triton.support import cdiv, next_power_of_2

    for n in [*range(0, 4100), 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(0, 300):
        for b in range(1, 40):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_planning_builds_launches_without_compiling(monkeypatch):
    """Inside ``planning`` the launch builders read the planned GPU's multiprocessors and nothing compiles."""
    from indexcache.backends.triton.launcher import planned_sms, planning

    launcher, jit = _fast_launcher(monkeypatch)
    x = torch.zeros(64, dtype=torch.int32)
    with planning(132):
        assert planned_sms() == 132
        assert launcher.resident(launch_key_options({"num_warps": 4}), x, 32, FLAG=True) is None
    assert planned_sms() is None
    assert jit.calls == []


# Triton 3.6's DependenciesFinder._update_hash (the H200's Triton): a callee's globals are merged before the callee is
# keyed, so a kernel's key depends on which callees the process keyed before it. Put in Triton 3.9's place to see it.
_KEY_IN_ORDER = """
import sys
import triton.runtime.jit as jit

def update_hash_36(self, func):
    self.used_global_vals.update(func.used_global_vals)
    self.hasher.update((func.cache_key + str(getattr(func, "noinline", False))).encode("utf-8"))

jit.DependenciesFinder._update_hash = update_hash_36
from indexcache.backends.triton.launcher import settle_cache_keys
from indexcache.backends.triton.topk import kernels

for name in sys.argv[1].split(","):
    getattr(kernels, name).cache_key
if sys.argv[2] == "settle":
    settle_cache_keys()
print(kernels.topk_sample_kernel.cache_key, kernels.topk_finish_kernel.cache_key)
"""


def test_kernels_are_keyed_alike_whatever_the_process_keyed_before():
    """With Triton 3.6's key order, the sample and finishing kernels keyed after others get other keys than keyed
    first (a warmed kernel would be looked up under another key); settle_cache_keys gives one key in every process."""
    import subprocess
    import sys

    def keys(first: str, settle: str) -> str:
        done = subprocess.run([sys.executable, "-c", _KEY_IN_ORDER, first, settle], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    orders = ("topk_sample_kernel", "topk_rows_kernel,topk_finish_kernel,topk_sample_kernel")
    assert keys(orders[0], "no") != keys(orders[1], "no")  # the order shows through without settling
    assert keys(orders[0], "settle") == keys(orders[1], "settle")


def test_a_bound_launch_hands_a_pinned_host_tensor_to_the_driver_to_map(monkeypatch):
    """Triton's launcher maps the address of what has ``data_ptr()`` (a pinned host tensor: cuPointerGetAttribute)
    and takes an int as a GPU address: a bound launch passes a pinned tensor's address as the former."""
    launcher, jit = _fast_launcher(monkeypatch)
    x, pinned = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.uint8)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: t.data_ptr() == pinned.data_ptr())
    launcher.bind((5,), launch_key_options({"num_warps": 4}), x, 32, FLAG=True)()
    launcher.bind((5,), launch_key_options({"num_warps": 4}), pinned, 32, FLAG=True)()
    assert jit.calls[1][1][9] == x.data_ptr()  # a GPU tensor (here any tensor not pinned): its address
    mapped = jit.calls[3][1][9]
    assert not isinstance(mapped, int) and mapped.data_ptr() == pinned.data_ptr()


def test_a_bound_launch_holds_a_tensor_descriptors_address_not_its_tensor(monkeypatch):
    """A kept Hopper decode or prefill launch held its tensor descriptors, whose bases are views of the cache, the keys
    and the queries: the memory stayed alive as long as the kept call after the caller freed it. The bound launch now
    holds a copy of each descriptor over its base's address alone (what Triton's launcher reads of it)."""
    import gc
    import weakref

    launcher, jit = _fast_launcher(monkeypatch)
    desc = _descriptors()[0]
    base = weakref.ref(desc.base)
    address, fields = desc.base.data_ptr(), (desc.shape, desc.strides, desc.block_shape, desc.layout, desc.padding)
    launch = launcher.bind((5,), launch_key_options({"num_warps": 4}), desc, 32, FLAG=True)
    jit.calls.clear()  # the stand-in's record of its warmup's arguments (Triton's own keeps none)
    del desc
    gc.collect()
    assert base() is None  # nothing the bound launch holds keeps the tensor
    launch()
    held = jit.calls[-1][1][9]
    assert type(held).__name__ == "TensorDescriptor" and not isinstance(held.base, torch.Tensor)
    assert held.base.data_ptr() == address
    assert (held.shape, held.strides, held.block_shape, held.layout, held.padding) == fields


def _package_kernels() -> list[JITFunction]:
    """Every ``@triton.jit`` function of the Triton backends' modules (their launchers' parameter lists)."""
    import importlib
    import pkgutil

    import indexcache.backends.triton as package

    found = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        found.update({id(v): v for v in vars(module).values() if isinstance(v, JITFunction)})
    return list(found.values())


def test_the_written_classifier_gives_each_parameter_its_rules_class():
    """Each kernel's generated ``_classes`` equals :func:`launcher._class_of` parameter by parameter, on values of
    every kind (ints at the class edges, tensors aligned or not, descriptors, bools, floats, None), under NVIDIA's
    tensor rule (given as a function of its own, and as the launcher's ``aligned16``, which the classifier writes in)
    and a rule of another backend's shape."""
    kernels = _package_kernels()
    assert len(kernels) > 20
    values = _values()

    def other_rule(t, align):  # AMD's shape: the alignment and whether the storage is small
        return (align and t.data_ptr() % 16 == 0, t.numel() < 32)

    for fn in kernels:
        launcher = Launcher(fn)
        rules = launcher._rules
        for shift in range(0, len(values), 7):
            row = tuple(values[(shift + i) % len(values)] for i in range(len(rules)))
            for rule in (_rule, launcher_module.aligned16, other_rule):
                want = [launcher_module._class_of(v, r, rule) for v, r in zip(row, rules, strict=True)]
                assert launcher._classes(row, rule) == want, fn.__name__
