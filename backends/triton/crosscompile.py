"""Cross-compile check: every Triton kernel of a GPU backend, built for each GPU generation it targets on a
machine without that GPU, and checked.

Each module of :data:`KERNEL_MODULES` declares ``compile_specs(target, tuning) -> list[KernelSpec]``:
every configuration its tuning table can choose on ``target`` (block shapes, fp8 dtype, code paths,
launch options). :func:`check` compiles them with ``triton.compile`` for the backend's targets (the
Triton wheel carries ptxas and the AMDGPU LLVM backend: no GPU, driver or ROCm install is needed) and
reads back registers, spills, scratch, shared memory / LDS and the matrix instructions. A result fails
when the kernel does not compile, spills to memory (VGPRs, a stack frame, scratch) or more than
:data:`MAX_SGPR_SPILLS` SGPRs (those land in VGPR lanes: listed, not failed, up to that many or the more a spec
allows), needs
more shared memory or threads than a block may have, is a matrix kernel without the target's matrix
instructions for its operand type, or feeds the fnuz fp8 formats to a target whose format they are not (gfx942's
to gfx950). A kernel module without ``compile_specs``, or a ``*_kernel`` that no spec covers, fails too, so kernels
added later are never skipped silently. Where the target's Triton backend compiles a pointer apart by the bytes its
tensor spans (AMD: tensors under 2 GiB take buffer loads and stores, larger ones global ones), each spec is built for
both (:func:`spans`), as a launch builds one or the other. The targets, their limits and how to read their builds come
from each GPU backend's architecture records (``backends/<vendor>/arch.py``).

This proves the kernels build for the target and use its matrix units; it runs nothing, so it says
nothing about speed or numerics on the card. Triton is imported only when something is compiled.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from indexcache.backends.triton import KERNEL_MODULES
from indexcache.backends.triton.target import INTERPRET_ENV, Target, interpreting, vendors

# Targets of each GPU backend's cross-compile check (its vendor record's ``cross_compile``).
TARGETS: dict[str, tuple[str, ...]] = {name: vendor.cross_compile for name, vendor in vendors().items()}
MAX_THREADS = 1024  # threads a block (NVIDIA) / work-items a workgroup (AMD), every target above
MAX_SGPR_SPILLS = 32  # AMD: SGPRs spilled into VGPR lanes that still pass (a few cold scalars)

_FP8_TOKENS = {"e4m3", "e5m2", "fp8", "bf8", "f8f6f4", "mxf8f6f4"}
_FNUZ = re.compile(r"f8E4M3FNUZ|f8E5M2FNUZ")  # fp8e4b8 / fp8e5b16 in the TTIR


@dataclass(frozen=True)
class KernelSpec:
    """One build of a Triton kernel: what a launch with one configuration of the tuning table compiles.

    ``types``: the Triton type of each parameter that is not an int32 scalar ("*fp8e4nv", "*i32", "fp32");
    ``constexprs``: compile-time values, including ints a launch specialises to constants (unit strides);
    ``aligned``: int parameters a typical launch passes divisible by 16 (pointers always are);
    ``options``: launch options (num_warps, num_stages, waves_per_eu); ``matrix``: the operand type whose
    matrix instructions the kernel must use ("fp8", "bf16", "fp16"; "scaled": a block-scaled one), None for kernels
    without ``tl.dot``;
    ``stack_bytes``: the NVIDIA stack frame the build may keep (0: none; a kernel that allows one says where
    ptxas puts it and why it is cold); ``sgpr_spills``: the AMD SGPR spills into VGPR lanes it may keep, where more
    than :data:`MAX_SGPR_SPILLS` (0: that many; a kernel that allows more says where they are and what was tried).
    """

    op: str
    fn: Any
    types: Mapping[str, str]
    constexprs: Mapping[str, Any]
    options: Mapping[str, Any]
    matrix: str | None = None
    aligned: tuple[str, ...] = ()
    stack_bytes: int = 0
    sgpr_spills: int = 0

    @property
    def kernel(self) -> str:
        """The kernel's name."""
        return self.fn.__name__

    def signature(self) -> dict[str, str]:
        """Every parameter's Triton type, "constexpr" for compile-time ones."""
        return {name: "constexpr" if name in self.constexprs else self.types.get(name, "i32")
                for name in self.fn.arg_names}

    def config(self) -> dict[str, Any]:
        """The configuration as JSON-able data: the pointers' element types, the kernel's constexpr parameters,
        then launch options (ints specialised to constants, such as unit strides, are left out)."""
        plain = (bool, int, float, str, type(None))
        declared = {p.name for p in self.fn.params if p.is_constexpr}
        dtypes = dict.fromkeys(t.removeprefix("*") for t in self.signature().values() if t.startswith("*"))
        chosen = {"dtypes": "/".join(dtypes), **{k: v for k, v in self.constexprs.items() if k in declared},
                  **self.options}
        return {k: v if isinstance(v, plain) else str(v) for k, v in chosen.items()}


def pointer(dtype: Any) -> str:
    """The Triton pointer type of a torch dtype (``torch.float8_e4m3fn`` → "*fp8e4nv")."""
    from triton._utils import type_canonicalisation_dict

    return "*" + type_canonicalisation_dict[str(dtype).removeprefix("torch.")]


def gpu_target(backend: str, arch: str) -> Target:
    """The :class:`Target` the backend builds for ``arch`` on that GPU (its vendor's record of ``arch``)."""
    return vendors()[backend].target(arch)


def operand_types(instruction: str) -> set[str]:
    """The operand types ("fp8", "bf16", "fp16", "tf32") a matrix instruction multiplies, and "scaled" where it
    applies block scales itself (NVIDIA ``kind::mxf8f6f4.block_scale``, AMD ``v_mfma_scale_*``)."""
    tokens = set(re.split(r"[._:]+", instruction))
    found = {"fp8"} if tokens & _FP8_TOKENS else set()
    if tokens & {"block_scale", "scale"}:
        found.add("scaled")
    if "bf16" in tokens or ("kind" in tokens and "f16" in tokens):  # tcgen05 kind::f16 takes fp16 and bf16
        found.add("bf16")
    if "f16" in tokens:
        found.add("fp16")
    if tokens & {"tf32", "xf32"}:
        found.add("tf32")
    return found


def _rules(spec: KernelSpec, target: Target, res: Mapping[str, int], matrix: list[str], ttir: str) -> list[str]:
    reasons = []
    # A few SGPR spills land in VGPR lanes (a v_writelane / v_readlane each, no memory traffic) and pass.
    if res.get("vgpr_spills"):
        reasons.append(f"spills: {res['vgpr_spills']} VGPRs")
    allowed = max(MAX_SGPR_SPILLS, spec.sgpr_spills)
    if res.get("sgpr_spills", 0) > allowed:
        reasons.append(f"spills: {res['sgpr_spills']} SGPRs (more than {allowed} into VGPR lanes)")
    if res.get("stack_bytes", 0) > spec.stack_bytes:
        allowed = f" (the kernel allows {spec.stack_bytes})" if spec.stack_bytes else ""
        reasons.append(f"spills: a {res['stack_bytes']}-byte stack frame in local memory{allowed}")
    if res["scratch_bytes"]:
        reasons.append(f"scratch: {res['scratch_bytes']} bytes of local/private memory a thread")
    limit = target.gpu.shared_per_block
    if res["shared_bytes"] > limit:
        reasons.append(f"shared memory: {res['shared_bytes']} bytes, above {target.arch}'s {limit} a block")
    if spec.matrix and not any(spec.matrix in operand_types(i) for i in matrix):
        found = ", ".join(matrix) or "none"
        reasons.append(f"matrix kernel without {spec.matrix} matrix instructions (found: {found})")
    if target.fp8_dtype != torch.float8_e4m3fnuz and _FNUZ.search(ttir):
        reasons.append(f"{target.arch} fed fnuz fp8 (e4m3fnuz/e5m2fnuz), not its fp8 format: Triton upcasts it to "
                       "fp16")
    return reasons


def _stderr_to_devnull() -> None:
    descriptor = os.open(os.devnull, os.O_WRONLY)
    os.dup2(descriptor, 2)
    os.close(descriptor)


@functools.cache
def _quiet_teardown() -> None:
    """Once per process that builds kernels: its stderr goes to /dev/null when the interpreter shuts down (atexit,
    after the results were returned, printed or written). libtriton's nanobind teardown otherwise prints a leak
    report at the exit of every such process (Triton 3.9: 4 ``ir.attribute`` instances, 7 types, ~330 functions,
    Triton's own and harmless at exit); Triton's compile warm-up pool silences its workers the same way."""
    atexit.register(_stderr_to_devnull)


# The bytes a pointer's tensor spans, by the name of its class in a result's config (``span``): AMD's Triton takes
# buffer loads and stores for a tensor whose storage spans at most 2^31 - 1 bytes (its "S" specialization).
SPANS = {"under 2 GiB": 2**31 - 1, "2 GiB or more": 2**31}


class _Pointer:
    """A pointer argument as Triton's specialization rule reads it: a 16-byte aligned address whose tensor spans
    ``span`` bytes (AMD's rule asks ``ptr_range()`` before a tensor's storage)."""

    def __init__(self, span: int):
        self.span = span

    def data_ptr(self) -> int:
        return 0

    def ptr_range(self) -> int:
        return self.span


@functools.cache
def _backend(target: Target) -> Any:
    """Triton's compiler backend for ``target`` (its specialization rule and attributes)."""
    from triton.compiler.compiler import make_backend

    return make_backend(target.gpu.triton_target())


def spans(target: Target) -> tuple[str | None, ...]:
    """The names (:data:`SPANS`) of the pointer spans ``target``'s Triton backend builds apart, as a launch's tensors
    have them; ``(None,)`` where the span takes no part (NVIDIA)."""
    rule = _backend(target).get_tensor_specialization
    keys = {name: rule(_Pointer(n), align=True) for name, n in SPANS.items()}
    return tuple(keys) if len(set(keys.values())) > 1 else (None,)


def build(spec: KernelSpec, target: Target, span: str | None = None) -> Any:
    """``spec`` compiled for ``target``: Triton's compiled kernel (its ``asm``: the PTX or AMDGCN, the binary, and on
    NVIDIA the SASS). Pointers are 16-byte aligned and ``aligned`` ints multiples of 16, unless the kernel
    specializes neither (``do_not_specialize``, ``do_not_specialize_on_alignment``), as a launch does; each pointer's
    tensor spans ``span`` (a name of :data:`SPANS`; None: under 2 GiB) where the kernel specializes it, as a launch
    reads it (Triton's rule for the target)."""
    import triton
    from triton.compiler import ASTSource

    signature = spec.signature()
    params = {p.name: p for p in spec.fn.params}
    backend = _backend(target)
    pointer_at = _Pointer(SPANS[span or "under 2 GiB"])
    attrs = {}
    for i, (name, ty) in enumerate(signature.items()):
        param = params[name]
        if ty.startswith("*") and not param.do_not_specialize:
            found = backend.parse_attr(backend.get_tensor_specialization(
                pointer_at, align=not param.do_not_specialize_on_alignment))
        elif name in spec.aligned and not (param.do_not_specialize or param.do_not_specialize_on_alignment):
            found = [["tt.divisibility", 16]]
        else:
            continue
        if found:
            attrs[(i,)] = found
    source = ASTSource
    if spec.fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(spec.fn, signature, dict(spec.constexprs), attrs), target=target.gpu.triton_target(),
                          options=dict(spec.options))


def compile_spec(spec: KernelSpec, target: Target, span: str | None = None) -> dict[str, Any]:
    """Compile ``spec`` for ``target`` (its pointers' tensors spanning ``span``: :func:`build`) and apply the rules:
    one JSON-able result, its config naming the span where one is given."""
    _quiet_teardown()

    config = spec.config() if span is None else {**spec.config(), "span": span}
    result: dict[str, Any] = {"target": target.arch, "op": spec.op, "kernel": spec.kernel, "config": config,
                              "status": "failed", "reasons": [], "resources": {}, "matrix": spec.matrix,
                              "matrix_instructions": [], "warnings": []}
    threads = spec.options.get("num_warps", 4) * target.warp_size
    if threads > MAX_THREADS:
        result["reasons"].append(f"{threads} threads a block ({spec.options['num_warps']} warps of "
                                 f"{target.warp_size}), above {MAX_THREADS}")
    start = time.perf_counter()
    try:
        # ptxas failures print the whole PTX on stdout; the error itself is kept.
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("always")
            compiled = build(spec, target, span)
    except Exception as exc:  # the compiler's error is the result
        result["seconds"] = round(time.perf_counter() - start, 2)
        result["reasons"].append(f"compile error: {type(exc).__name__}: {str(exc).strip()[:1500]}")
        return result
    result["seconds"] = round(time.perf_counter() - start, 2)
    result["warnings"] = [str(w.message) for w in caught if "triton/language" in w.filename.replace("\\", "/")]
    vendor = target.gpu.vendor
    result["resources"] = vendor.resources(compiled)
    result["matrix_instructions"] = sorted(set(vendor.matrix_instructions.findall(compiled.asm[vendor.asm])))
    result["reasons"] += _rules(spec, target, result["resources"], result["matrix_instructions"],
                                compiled.asm["ttir" if "ttir" in compiled.asm else "ttgir"])  # Gluon: no ttir
    result["status"] = "failed" if result["reasons"] else "passed"
    return result


def declared(backend: str, arch: str, tuning: Mapping[str, Mapping[str, Any]] | None = None
             ) -> list[tuple[str, list[KernelSpec] | None, list[str]]]:
    """Per kernel module: its specs for ``arch`` (None without ``compile_specs``) and its ``*_kernel`` names (a
    package's: those it exposes from its own modules); under ``tuning`` where given, else the backend's table."""
    tuning = tuning or importlib.import_module(f"indexcache.backends.{backend}.tuning").tuning(arch)
    target = gpu_target(backend, arch)
    found = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"indexcache.backends.triton.{name}")
        kernels = sorted(k for k, v in vars(module).items() if k.endswith("_kernel")
                         and f"{getattr(v, '__module__', None)}.".startswith(f"{module.__name__}."))
        specs = module.compile_specs(target, tuning) if hasattr(module, "compile_specs") else None
        found.append((name, specs, kernels))
    return found


def _failure(backend: str, arch: str, module: str, kernel: str | None, reason: str) -> dict[str, Any]:
    return {"backend": backend, "target": arch, "module": module, "op": None, "kernel": kernel, "config": {},
            "status": "failed", "reasons": [reason], "resources": {}, "matrix": None, "matrix_instructions": [],
            "warnings": []}


_CACHE: dict[tuple[str, str], list[dict[str, Any]]] = {}


def check_target(backend: str, arch: str, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every declared kernel configuration of ``backend`` compiled for ``arch``; cached for the process."""
    key = (backend, arch)
    if key in _CACHE:
        return _CACHE[key]
    target = gpu_target(backend, arch)
    results = []
    for module, specs, kernels in declared(backend, arch):
        if specs is None:
            results.append(_failure(backend, arch, module, None, "no compile specs declared"))
            continue
        for kernel in sorted(set(kernels) - {s.kernel for s in specs}):
            results.append(_failure(backend, arch, module, kernel, "kernel has no compile spec"))
        for spec in specs:
            for span in spans(target):
                result = {"backend": backend, "module": module, **compile_spec(spec, target, span)}
                results.append(result)
                if progress:
                    progress(f"[{backend} {arch}] {result['status']:<6} {result['kernel']} {result['seconds']:.1f}s "
                             f"{_config_text(result['config'])}")
    _CACHE[key] = results
    return results


def check(backend: str, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every declared kernel configuration of ``backend`` ("cuda" or "rocm") on each of its targets."""
    return [r for arch in TARGETS[backend] for r in check_target(backend, arch, progress)]


def to_stderr(line: str) -> None:
    """A progress callback: the line on stderr."""
    print(line, file=sys.stderr, flush=True)


def check_targets(runs: list[tuple[str, str]], jobs: int = 1,
                  progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """:func:`check_target` for each ``(backend, arch)``, in ``jobs`` worker processes when > 1 (``progress``
    must then be a module-level function, such as :func:`to_stderr`)."""
    if jobs <= 1:
        return [r for backend, arch in runs for r in check_target(backend, arch, progress)]
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold Triton/torch threads
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = [pool.submit(check_target, backend, arch, progress) for backend, arch in runs]
        return [r for future in futures for r in future.result()]


def compiled_for(backend: str) -> list[dict[str, Any]]:
    """:func:`check` for a conformance report; in a child process without ``TRITON_INTERPRET`` when this
    one interprets Triton (interpreted kernels cannot be compiled). Progress goes to stderr."""
    if not interpreting():
        return check(backend, progress=to_stderr)
    env = {k: v for k, v in os.environ.items() if k != INTERPRET_ENV}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "compile.json"
        cmd = [sys.executable, "-m", "indexcache.tools.cli", "compile-check", "--backend", backend, "--json", str(path)]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL)
        if not path.exists():
            raise RuntimeError(f"the compile check of {backend} crashed (exit {proc.returncode})")
        return json.loads(path.read_text())


def failed(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results that break a rule."""
    return [r for r in results if r["status"] == "failed"]


def why(result: Mapping[str, Any]) -> str:
    """The result's reasons on one line."""
    return "; ".join(" ".join(reason.split()) for reason in result["reasons"])


def _config_text(config: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


def _registers(res: Mapping[str, int]) -> str:
    if "regs" in res:
        return str(res["regs"])
    return f"{res['vgpr']} v / {res['agpr']} a / {res['sgpr']} s" if res else "-"


def _spills(res: Mapping[str, int]) -> str:
    if not res:
        return "-"
    spilled = [f"{res[k]} {k.removesuffix('_spills')}" for k in ("vgpr_spills", "sgpr_spills") if res.get(k)]
    if res.get("stack_bytes"):
        spilled.append(f"{res['stack_bytes']} B stack")
    if res["scratch_bytes"]:
        spilled.append(f"{res['scratch_bytes']} B scratch")
    return ", ".join(spilled) or "0"


def _matrix(result: Mapping[str, Any]) -> str:
    if not result["matrix"] or not result["resources"]:
        return "-"
    return ", ".join(result["matrix_instructions"]) or "none"


def rows(results: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Table rows: target, kernel, config, status, registers, spills/scratch, shared bytes, matrix instructions,
    and why it failed."""
    out = []
    for r in results:
        res = r["resources"]
        out.append((r["target"], r["kernel"] or r["module"], _config_text(r["config"]), r["status"], _registers(res),
                    _spills(res), str(res["shared_bytes"]) if res else "-", _matrix(r), why(r)))
    return out


HEADER = ("target", "kernel", "config", "status", "registers", "spills / scratch", "shared B", "matrix instructions",
          "why it failed")


def format_table(results: list[dict[str, Any]]) -> str:
    """A plain-text table of the results."""
    table = [HEADER, *rows(results)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table)


def markdown(results: list[dict[str, Any]]) -> list[str]:
    """The "compiled for" section of a backend's conformance report."""
    import triton

    targets = ", ".join(dict.fromkeys(r["target"] for r in results))
    lines = [
        "## Compiled for (cross-compiled, not run)",
        "",
        f"Triton {triton.__version__} built every kernel configuration this backend's tuning tables can choose "
        f"for {targets} on this machine. Nothing ran on those GPUs: this shows the kernels build and use the "
        "matrix units, not their speed or numerics there. Rules: compiles; no spills to memory or scratch, at most "
        f"{MAX_SGPR_SPILLS} SGPR spills (into VGPR lanes), or the more a kernel allows (its spec's sgpr_spills); "
        "shared memory "
        f"within the target's limit a block; at most {MAX_THREADS} threads a block; matrix kernels use the "
        "target's matrix instructions for their operand type; no fnuz fp8 on gfx950.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for row in rows(results):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    return lines
