"""Launching a ``@triton.jit`` kernel with less host work than ``kernel[grid](...)``.

Triton's own launch (``JITFunction.run``) binds the arguments, builds its specialization key, reads its
knobs and fills launch metadata on every call: on the H200's host 10–15 µs for an empty kernel and 20–31 µs
with translate's 18 arguments (docs/kernels.md, "Host cost of a launch"). A :class:`Launcher` pays that
once per specialization: the first call of one goes through Triton, which compiles (or loads) the kernel
and launches it, and the compiled kernel is kept; later calls of the same specialization hand the
arguments straight to the compiled kernel's launcher.

A specialization is what Triton compiles a kernel for, and the key here is never coarser than Triton's:
the launch options, the constexpr values, each tensor's dtype and 16-byte alignment (on AMD the backend's
own rule, which adds whether the storage spans less than 2 GiB), each int's class (1, a multiple of 16,
32 or 64 bits), each tensor descriptor's type, dtype, block shape, shared layout and base alignment, the type of
anything else, and the current device. A parameter the kernel lists in ``do_not_specialize`` keeps only its type
(an int its width, a tensor its dtype), one in ``do_not_specialize_on_alignment`` drops the alignment, as Triton's
own key does (docs/kernels.md, "Kernel variants"). Interpreted (``TRITON_INTERPRET=1``)
and while a launch hook is installed (a profiler such as proton), every call goes through Triton; interpreted
launches run one at a time in the process (Triton's interpreter keeps the program being run in one global).

Inside :func:`planning` launches are only built, for a GPU that need not be here: nothing is compiled and
:meth:`Launcher.resident` answers None (``indexcache warmup`` lists and builds the variants that way).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from indexcache.hal import budget
from indexcache.hal.device import resident_blocks, sm_limits

Options = tuple[tuple[str, Any], ...]


def launch_key_options(options: dict[str, Any]) -> Options:
    """Launch options (``num_warps``, ``num_stages``, …) as the hashable, ordered tuple a launch takes."""
    return tuple(sorted(options.items()))


FOUR_WARPS = launch_key_options({"num_warps": 4})  # the options of the small fixed launches (draft rows, windows, …)


def _hooked() -> bool:
    """Whether a launch hook is installed (Triton calls it with per-launch metadata only on its own path)."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and (not hasattr(hook, "calls") or hook.calls):
            return True
    return False


# Triton's interpreter runs a launch's programs through one global builder holding the program index
# (triton/runtime/interpreter.py, interpreter_builder): two threads' launches at once would mix their programs.
_INTERPRETER = threading.Lock()


def _interpret(fn: Any, grid: Sequence[int], options: Options, args: tuple, named: dict[str, Any]) -> None:
    """One launch of an interpreted kernel, while no other thread's runs."""
    with _INTERPRETER:
        fn[tuple(grid)](*args, **named, **dict(options))


_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)


def _int_class(v: int) -> int:
    """Triton's classes of an int argument: 1 (a constant), a multiple of 16 or not, 32, 64 or unsigned 64 bits."""
    if v == 1:
        return 0
    return 2 * _int_width(v) + (v % 16 == 0)


def _int_width(v: int) -> int:
    """The class of an int argument Triton does not specialize (``do_not_specialize``): 32, 64 or unsigned 64 bits."""
    return 1 if _I32[0] <= v < _I32[1] else 2 if _I64[0] <= v < _I64[1] else 3


# What the key keeps of a parameter (Triton's own rule for it): its value (a constexpr), its full class, its type
# only (``do_not_specialize``), or its class without alignment (``do_not_specialize_on_alignment``).
_CONSTEXPR, _SPECIALIZED, _TYPE_ONLY, _UNALIGNED = range(4)
_PLANNING: contextvars.ContextVar[int | None] = contextvars.ContextVar("indexcache_planning", default=None)


@contextlib.contextmanager
def planning(sms: int) -> Iterator[None]:
    """Inside, launches are built as data for a GPU of ``sms`` multiprocessors that need not be present (meta tensors
    are fine): :func:`planned_sms` answers ``sms`` and :meth:`Launcher.resident` None, so nothing compiles."""
    token = _PLANNING.set(sms)
    try:
        yield
    finally:
        _PLANNING.reset(token)


def planned_sms() -> int | None:
    """The multiprocessors of :func:`planning`'s GPU inside it, else None (the launch builders ask the device)."""
    return _PLANNING.get()


def sm_budget(sms: int) -> int | None:
    """The SM budget in force (:mod:`indexcache.hal.budget`) where it is below the GPU's ``sms`` multiprocessors,
    else None (the whole device)."""
    n = budget.current()
    return n if n is not None and n < sms else None


def persistent_programs(sms: int, per_sm: int) -> int:
    """Programs of a persistent launch on a GPU of ``sms`` multiprocessors that each hold ``per_sm`` of them:
    ``sms * per_sm``, or under an SM budget of n below ``sms`` n, one a multiprocessor (n programs occupy at most n
    multiprocessors however the hardware places them; ``per_sm`` of them might spread over ``per_sm * n``)."""
    n = sm_budget(sms)
    return sms * per_sm if n is None else n


_SETTLED: set[int] = set()
_SETTLING = threading.Lock()
_MODULES_SETTLED = [-1]  # len(sys.modules) when the last settling ended: modules are only ever added


def settle_cache_keys() -> None:
    """Key every Triton function of this package's loaded modules the same way in every process, before this process
    compiles or looks up one of its kernels.

    Triton 3.6 keys a kernel by its callees' keys and the constexpr globals the callees use, but merges a callee's
    globals only if that callee was keyed before (its ``DependenciesFinder._update_hash``; 3.9 keys the callee first):
    the key of a kernel then depends on what the process keyed before it, and a kernel compiled ahead (``indexcache
    warmup``) is looked up under another key. Here the functions not settled yet are keyed again until no key changes:
    each then holds all of its callees' globals, whatever the order (Triton 3.9 gives these keys at once)."""
    import sys

    if len(sys.modules) == _MODULES_SETTLED[0]:  # no module loaded since: nothing new to key (a first call's path)
        return
    with _SETTLING:
        count = len(sys.modules)
        fns = {id(v): v for name, module in list(sys.modules.items())
               if name.startswith(__package__ + ".") and module is not None
               for v in vars(module).values() if isinstance(v, JITFunction) and id(v) not in _SETTLED}
        keys = None
        while fns:
            for fn in fns.values():
                fn.hash = None
            now = [fn.cache_key for fn in fns.values()]
            if now == keys:
                break
            keys = now
        _SETTLED.update(fns)
        _MODULES_SETTLED[0] = count


def _class_of(v: Any, rule: int, tensor_rule: Callable[[Any, bool], Any]) -> Any:
    """What a launch's key keeps of one parameter's value ``v`` under its ``rule`` (see the module docstring):
    ``tensor_rule(t, align)`` is the backend's class of a tensor's address."""
    if rule == _CONSTEXPR:
        return v
    kind = type(v)
    if kind is int:
        return _int_width(v) if rule == _TYPE_ONLY else _int_class(v)
    if isinstance(v, torch.Tensor):
        return v.dtype if rule == _TYPE_ONLY else (v.dtype, tensor_rule(v, rule == _SPECIALIZED))
    if hasattr(v, "block_shape") and hasattr(v, "base"):  # a host tensor descriptor (TMA)
        return kind, v.base.dtype, tuple(v.block_shape), getattr(v, "layout", None), tensor_rule(v.base, True)
    return kind


_WIDTH = "(1 if -2147483648 <= {v} < 2147483648 else 2 if -9223372036854775808 <= {v} < 9223372036854775808 else 3)"


def aligned16(t: torch.Tensor, align: bool) -> bool:
    """The tensor rule of Triton's ``BaseBackend`` (NVIDIA's): 16-byte alignment where ``align``."""
    return align and t.data_ptr() % 16 == 0


def _classifier(rules: Sequence[int]) -> Callable[[tuple, Callable[[Any, bool], Any]], list]:
    """``classes(values, tensor_rule)``, the list ``[_class_of(v, rule, tensor_rule)]`` over a kernel's parameters, as
    one function written for their rules: each parameter one expression, an int's class and a tensor's computed in
    it, any other value through :func:`_class_of`; where ``tensor_rule`` is :func:`aligned16` (NVIDIA), a tensor's
    written in too. A launch of a new signature builds its key this way (a kernel has up to 44 parameters; the loop
    over :func:`_class_of` took 8-15 µs on the CI machine, this 3-5)."""
    names = [f"v{i}" for i in range(len(rules))]
    items, nvidia = [], []  # each parameter's expression under any tensor rule, and under aligned16
    for v, rule in zip(names, rules, strict=True):
        if rule == _CONSTEXPR:
            items.append(v)
            nvidia.append(v)
        elif rule == _TYPE_ONLY:
            items.append(f"({_WIDTH.format(v=v)} if type({v}) is int else {v}.dtype if type({v}) is T "
                         f"else of({v}, {rule}, tr))")
            nvidia.append(items[-1])
        else:
            align = rule == _SPECIALIZED
            written = f"{v}.data_ptr() % 16 == 0" if align else "False"  # aligned16(v, align)
            for found, tensor in ((items, f"({v}.dtype, tr({v}, {align}))"), (nvidia, f"({v}.dtype, {written})")):
                found.append(f"((0 if {v} == 1 else 2 * {_WIDTH.format(v=v)} + ({v} % 16 == 0)) if type({v}) is int "
                             f"else {tensor} if type({v}) is T else of({v}, {rule}, tr))")
    unpack = f"    {', '.join(names)}, = values\n" if names else ""
    source = (f"def classes(values, tr):\n{unpack}    if tr is aligned16:\n        return [{', '.join(nvidia)}]\n"
              f"    return [{', '.join(items)}]\n")
    namespace: dict[str, Any] = {"T": torch.Tensor, "of": _class_of, "aligned16": aligned16}
    exec(source, namespace)  # noqa: S102  (source built here from the rules' four values and parameter positions)
    return namespace["classes"]


def _rule(param: Any) -> int:
    if param.is_constexpr:
        return _CONSTEXPR
    if param.do_not_specialize:
        return _TYPE_ONLY
    return _UNALIGNED if param.do_not_specialize_on_alignment else _SPECIALIZED


class Launcher:
    """``fn`` launched through its compiled launcher once Triton has built it for a specialization.

    ``launcher(grid, options, *args, **named)``: ``grid`` a tuple of one to three ints, ``options`` from
    :func:`launch_key_options`, then every parameter of the kernel (no defaults), the first ones by position
    and the rest by name. Returns nothing.
    """

    def __init__(self, fn: Any):
        self.fn = fn
        self._fast = isinstance(fn, JITFunction)  # not under TRITON_INTERPRET (an InterpretedFunction)
        self._names: tuple[str, ...] = tuple(fn.arg_names)
        self._rules: tuple[int, ...] = tuple(_rule(p) for p in fn.params) if self._fast else ()
        # (values, tensor_rule) -> each parameter's class; interpreted, no key is built
        self._classes = _classifier(self._rules) if self._fast else None
        self.__name__ = getattr(fn, "__name__", "kernel")
        self._kernels: dict[tuple, Any] = {}
        self._resident: dict[tuple, int | None] = {}  # resident()'s answer by specialization key
        self._driver: tuple | None = None  # (current device, current stream, tensor rule), bound at first use

    def __call__(self, grid: Sequence[int], options: Options, *args: Any, **named: Any) -> None:
        self.launch(grid, options, args, named)

    def launch(self, grid: Sequence[int], options: Options, args: tuple, named: dict[str, Any]) -> None:
        """The launch ``launcher(grid, options, *args, **named)``, its arguments as they are held (a
        :class:`Launch`'s: not unpacked into a call and packed again)."""
        values = self._values(args, named)
        if not self._fast:
            _interpret(self.fn, grid, options, args, named)
            return
        if _hooked():
            settle_cache_keys()
            self.fn[tuple(grid)](*args, **named, **dict(options))
            return
        device, key = self._key(options, values)
        kernel = self._kernels.get(key)
        if kernel is None:
            settle_cache_keys()
            self._kernels[key] = self.fn[tuple(grid)](*args, **named, **dict(options))
            return
        gx = grid[0]
        gy = grid[1] if len(grid) > 1 else 1
        gz = grid[2] if len(grid) > 2 else 1
        kernel.run(gx, gy, gz, self._driver[1](device), kernel.function, kernel.packed_metadata, None, None, None,
                   *values)

    def bind(self, grid: Sequence[int], options: Options, *args: Any, **named: Any) -> Callable[[], None]:
        """This launch as a callable that repeats it with the same arguments, compiled now (nothing launched).

        The callable keeps the tensors' addresses, not the tensors (nor a tensor descriptor's base:
        :func:`_descriptor_by_address`): it is valid while memory of the same layout lies there (the caller's
        contract); a pinned host tensor's address is mapped into the GPU's by the driver at
        each launch, as Triton's launcher does for the tensor (:class:`_Mapped`). Interpreted, it launches through
        Triton on tensors found by the same addresses (:func:`_by_address`), so it keeps no memory alive there
        either."""
        values = self._values(args, named)
        if not self._fast:
            args = tuple(_by_address(a) if isinstance(a, torch.Tensor) else a for a in args)
            named = {n: _by_address(v) if isinstance(v, torch.Tensor) else v for n, v in named.items()}
            return lambda: _interpret(self.fn, grid, options, args, named)
        device, key = self._key(options, values)
        kernel = self._compiled(key, options, args, named)
        plain = tuple(_address(v) if isinstance(v, torch.Tensor) else
                      _descriptor_by_address(v) if isinstance(getattr(v, "base", None), torch.Tensor) else v
                      for v in values)
        gx, gy, gz = (*grid, 1, 1)[:3]
        current_stream = self._driver[1]
        run = kernel.run  # first: loads the compiled kernel (its function handle) where only warmed up
        function, metadata = kernel.function, kernel.packed_metadata

        def launch() -> None:
            stream = current_stream(device)
            if _hooked():  # a profiler's hooks get what Triton's own launch gives them
                hooks = knobs.runtime
                run(gx, gy, gz, stream, function, metadata, kernel.launch_metadata(grid, stream, *plain),
                    hooks.launch_enter_hook, hooks.launch_exit_hook, *plain)
            else:
                run(gx, gy, gz, stream, function, metadata, None, None, None, *plain)

        return launch

    def resident(self, options: Options, *args: Any, **named: Any) -> int | None:
        """Programs of this specialization one NVIDIA multiprocessor holds at once, from the compiled kernel's
        registers and shared memory (compiled now where it was not yet; nothing launched). None interpreted or on
        AMD: the caller's tuning table decides there."""
        if not self._fast or planned_sms() is not None:
            return None
        device, key = self._key(options, self._values(args, named))
        if key in self._resident:
            return self._resident[key]
        kernel = self._compiled(key, options, args, named)
        # Reading ``run`` loads the compiled module, which is when Triton learns the register count.
        if kernel.run is None or kernel.metadata.target.backend != "cuda":
            found = None
        else:
            found = resident_blocks(kernel.n_regs, kernel.metadata.shared, kernel.metadata.num_warps * 32,
                                    sm_limits(device))
        self._resident[key] = found
        return found

    def load(self, options: Options, *args: Any, **named: Any) -> None:
        """Make this specialization's kernel ready here: taken from Triton's cache (compiled where it is not), kept
        under this launcher's key and loaded onto the current GPU, so that a first launch of it goes straight to the
        compiled kernel (``indexcache.warmup``). Tensors may be meta tensors (only their dtype and address count).
        Nothing is launched; nothing done interpreted."""
        if not self._fast:
            return
        _, key = self._key(options, self._values(args, named))
        _ = self._compiled(key, options, args, named).run  # reading it loads the module onto the current GPU

    def _compiled(self, key: tuple, options: Options, args: tuple, named: dict) -> Any:
        """The compiled kernel kept under ``key``, through Triton's ``warmup`` (its cache) the first time."""
        kernel = self._kernels.get(key)
        if kernel is None:
            settle_cache_keys()
            kernel = self._kernels[key] = self.fn.warmup(*args, grid=(1,), **named, **dict(options))
        return kernel

    def _key(self, options: Options, values: tuple) -> tuple[int, tuple]:
        """``(current device, specialization key)`` of a launch with these values."""
        if self._driver is None:
            self._driver = _bind_driver()
        current_device, _, tensor_rule = self._driver
        device = current_device()
        return device, (device, options, *self._classes(values, tensor_rule))

    def _values(self, args: tuple, named: dict) -> tuple:
        """Every parameter's value in the kernel's order; a TypeError naming what is missing or unexpected."""
        given = len(args)
        try:
            values = args + tuple(map(named.__getitem__, self._names[given:]))
        except KeyError:
            values = ()
        if len(values) != given + len(named):
            rest = self._names[given:]
            raise TypeError(f"{self.__name__}: expected {len(self._names)} arguments, missing "
                            f"{[n for n in rest if n not in named]}, unexpected {[n for n in named if n not in rest]}")
        return values


class _Mapped:
    """A pinned host tensor's address in a bound launch (and a tensor descriptor's base's:
    :func:`_descriptor_by_address`). Triton's launcher takes an int argument as the GPU address it is, but asks
    anything else for ``data_ptr()`` and maps that address into the GPU's address space (``cuPointerGetAttribute`` /
    ``hipPointerGetAttribute``, as it does for a tensor given to it): under unified addressing a pinned buffer's GPU
    address is usually its host address, and this keeps the driver's word for it (and its error for memory that is
    not pinned)."""

    __slots__ = ("address",)

    def __init__(self, address: int):
        self.address = address

    def data_ptr(self) -> int:
        return self.address

    def __repr__(self) -> str:
        return f"_Mapped({self.address:#x})"


def _descriptor_by_address(desc: Any) -> Any:
    """A copy of tensor descriptor ``desc`` (Triton's or Gluon's) whose base is its address alone (:class:`_Mapped`):
    what a bound launch holds, so that a kept call keeps no tensor, and no memory, alive (the Hopper decode's and
    prefill's descriptors are over the cache, the keys and the queries). A launch reads of the base only its
    ``data_ptr()`` (the copy engine's descriptor is filled from it, or a decomposed one passes it as a pointer)."""
    held = copy.copy(desc)  # not through __init__: its checks read the base's dtype
    object.__setattr__(held, "base", _Mapped(desc.base.data_ptr()))
    return held


def _address(t: torch.Tensor) -> int | _Mapped:
    """What a bound launch passes for tensor ``t``: its address, mapped by the driver at each launch where ``t`` is
    pinned host memory (a kernel reading it directly, such as the HiSparse swap-in)."""
    return _Mapped(t.data_ptr()) if t.device.type == "cpu" and t.is_pinned() else t.data_ptr()


def _by_address(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s dtype, shape and strides over the host memory at ``t``'s address, owning none of it: what
    an interpreted bound launch holds in place of ``t``, as a compiled one holds the address (interpreted kernels
    take host tensors only)."""
    if t.device.type != "cpu":
        raise ValueError(f"an interpreted launch takes host tensors, got one on {t.device}")
    if t.numel() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    memory = (ctypes.c_byte * (span * t.element_size())).from_address(t.data_ptr())
    return torch.frombuffer(memory, dtype=torch.uint8).view(t.dtype).as_strided(t.shape, t.stride())


@dataclass(frozen=True)
class Launch:
    """One launch of a kernel, as data: ``launch()`` runs it, ``launch.bind()`` gives a callable that repeats it
    (:meth:`Launcher.bind`)."""

    launcher: Launcher
    grid: tuple[int, ...]
    options: Options
    args: tuple
    named: dict[str, Any]

    def __call__(self) -> None:
        self.launcher.launch(self.grid, self.options, self.args, self.named)

    def bind(self) -> Callable[[], None]:
        return self.launcher.bind(self.grid, self.options, *self.args, **self.named)


def _bind_driver():
    """The active Triton driver's current-device and current-stream functions, and the tensor rule of its
    compiler backend, ``tensor_rule(t, align)`` (16-byte alignment where ``align``, plus the backend's own additions
    where it overrides the rule)."""
    from triton.backends.compiler import BaseBackend
    from triton.compiler.compiler import make_backend
    from triton.runtime.driver import driver

    active = driver.active
    backend = make_backend(active.get_current_target())
    rule = type(backend).get_tensor_specialization
    if rule is BaseBackend.get_tensor_specialization:
        tensor_rule = aligned16
    else:
        def tensor_rule(t, align):
            return rule(t, align=align)
    return active.get_current_device, active.get_current_stream, tensor_rule


def bound(launches: Sequence[Launch | None]) -> Callable[[], None]:
    """One callable repeating ``launches`` in order (None: nothing to launch), each bound now."""
    binds = tuple(launch.bind() for launch in launches if launch is not None)
    if len(binds) == 1:
        return binds[0]

    def run() -> None:
        for launch in binds:
            launch()

    return run
