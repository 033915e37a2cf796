"""The argument checks the ops share: metadata only (shapes, dtypes, devices), never a device sync.

Each raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, device or value) naming the
argument, what was expected and what came.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from indexcache.hal import dispatch, fp4
from indexcache.hal.layout import FP8_DTYPES, cache_page_size
from indexcache.hal.shown import dims, given, shown

INDEX = torch.int32  # every index tensor; -1 marks an empty slot
SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KEY_DTYPES = (*FP8_DTYPES, torch.bfloat16)
FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
# The largest k: the shipped models select 512-2048; 65536 leaves room and bounds an output row at 256 KiB.
MAX_TOPK = 65536
# Slots are int32, so a page holds at most 2^31 - 1 tokens.
MAX_PAGE_SIZE = 2**31 - 1


def dtype_names(dtypes) -> str:
    """``"float32 or bfloat16"``: dtypes as an error message names them."""
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, t, dtypes, shape: tuple, device: torch.device | None = None) -> None:
    """Check ``t`` is a tensor of one of ``dtypes`` whose shape matches ``shape`` (None = any size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {dtype_names(dtypes)}, got {dtype_names([t.dtype])}")
    got = t.shape
    bad = len(got) != len(shape)
    if not bad:
        for w, g in zip(shape, got, strict=True):  # a loop, not any() over a generator: every tensor of a call
            if w is not None and w != g:
                bad = True
                break
    if bad:
        want = "[" + ", ".join(["*" if s is None else str(shown(s)) for s in shape]) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {dims(got)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")


def check_int(name: str, value, minimum: int, maximum: int | None = None, why: str = "") -> int:
    """``value``, checked to be an int (not a bool) in ``[minimum, maximum]``; ``why`` explains the bound."""
    # A SymInt only comes from Dynamo tracing with dynamic shapes (the custom op checks the real int again).
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {given(value)!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}: expected an int {bounds}{why}, got {shown(value)}")
    return value


def check_bool(name: str, value) -> bool:
    """``value``, checked to be a bool (a flag: ``1``, ``"no"`` or a tensor are not taken for one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {given(value)!r}")
    return value


def check_k(k) -> int:
    """``k`` in ``[0, MAX_TOPK]``."""
    return check_int("k", k, 0, MAX_TOPK, " (indexcache.hal.ops.MAX_TOPK)")


def check_page_size(page_size) -> int:
    """``page_size`` in ``[1, MAX_PAGE_SIZE]``."""
    return check_int("page_size", page_size, 1, MAX_PAGE_SIZE, " (slots are int32)")


def key_format(fp8_dtype, device: torch.device, block: int | None = None,
               given: torch.Tensor | None = None) -> torch.dtype:
    """The keys' format an op's ``fp8_dtype`` names: an fp8 format (any ``block`` >= 1), MXFP4
    (``torch.float4_e2m1fn_x2``, ``block`` 32), or None: the format of the keys' output ``given`` where the caller
    gave one in such a format, else the fp8 format native to ``device`` (:func:`indexcache.hal.dispatch.native_fp8`:
    e4m3fnuz on an MI300, else e4m3fn); ``block`` None: an op without one (the cache store)."""
    formats = (*FP8_DTYPES, fp4.FP4)
    if fp8_dtype is None:
        fp8_dtype = (given.dtype if isinstance(given, torch.Tensor) and given.dtype in formats
                     else dispatch.native_fp8(device))
    elif fp8_dtype not in formats:
        raise TypeError(f"fp8_dtype: expected None (the device's native fp8 format) or {dtype_names(formats)}, got "
                        f"{fp8_dtype!r}")
    if block is not None:
        check_int("block", block, 1)
        if fp8_dtype == fp4.FP4 and block != fp4.BLOCK:
            raise ValueError(f"block: MXFP4 keys take a scale every {fp4.BLOCK} elements, got block={shown(block)}")
    return fp8_dtype


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, end)`` a tensor's elements lie in (empty for an empty tensor)."""
    first = t.data_ptr()
    if t.is_contiguous():  # the common case, without a Python loop over the dimensions
        return first, first + t.nbytes
    if t.numel() == 0:
        return first, first
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return first, first + (last + 1) * t.element_size()


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of a non-contiguous ``t`` may share memory: its dimensions of more than one element,
    by stride, must each step past all the smaller ones span (a view such as ``as_strided((2, 3), (1, 1))`` does
    not; a few exotic views that interleave without overlapping are refused with them)."""
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def check_output(name: str, out: torch.Tensor, inputs: dict) -> None:
    """``out`` must not write one element twice (an expanded, stride-0 view or any view whose elements overlap) nor
    share memory with any input."""
    # Fake and meta tensors (Dynamo's tracing, the custom ops' fake implementations) have no memory to compare, and
    # symbolic strides the general overlap test cannot order: traced, only the stride-0 test runs; the custom op's real
    # implementation runs this check again on the real tensors (indexcache.hal.library).
    traced = torch.compiler.is_compiling() or out.is_meta or isinstance(out, FakeTensor)
    if not out.is_contiguous():
        expanded = any(size > 1 and stride == 0 for size, stride in zip(out.shape, out.stride(), strict=True))
        if expanded or (not traced and out.numel() and _overlaps_itself(out)):
            raise ValueError(f"{name}: expected a tensor whose elements have memory of their own, got "
                             f"{'an expanded view' if expanded else 'a view whose elements overlap'} "
                             f"(shape {dims(out.shape)}, strides {dims(out.stride())})")
    if traced:
        return
    o0, o1 = _span(out)  # compared with each input's span (metadata only: never a device sync)
    for other, t in inputs.items():
        if not isinstance(t, torch.Tensor):
            continue
        t0, t1 = _span(t)
        if o0 < t1 and t0 < o1 and out.device == t.device:
            raise ValueError(f"{name}: expected a tensor that shares no memory with the other tensor arguments, "
                             f"got one that overlaps {other}")


def output(name: str, out, dtype, shape: tuple, device: torch.device, inputs: dict) -> torch.Tensor:
    """The output ``out`` checked (dtype, shape, device, no overlap with ``inputs``), or a new one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, out, (dtype,), shape, device)
    check_output(name, out, inputs)
    return out


def _misaligned(t: torch.Tensor) -> str | None:
    """Where ``t``'s first element lies off a multiple of 4 bytes, for an error message (None: it does not): by its
    address, which a kept call's signature holds (:mod:`indexcache.hal.memo`; a storage offset does not show a storage
    that itself starts off one, as ``torch.frombuffer`` of a buffer's third byte does); by its storage offset on fake
    and meta tensors, which have no address. None under compile (Dynamo traces neither: the custom op's real
    implementation checks it)."""
    if torch.compiler.is_compiling():
        return None
    offset = t.storage_offset()
    if (offset if t.is_meta or isinstance(t, FakeTensor) else t.data_ptr()) % 4 == 0:
        return None
    return f"storage offset {offset}" + ("" if offset % 4 else " of a storage that starts off a 4-byte boundary")


def check_workspace(workspace, device: torch.device, tensors: dict) -> None:
    """A caller's ``workspace`` (None: the backend's own, docs/ops.md "Workspace"): a 1-D contiguous uint8 tensor on
    ``device`` starting at a multiple of 4 bytes, sharing no memory with ``tensors``. That it holds enough bytes
    depends on the backend: :func:`indexcache.hal.dispatch.check_workspace_size` checks it once one is chosen."""
    if workspace is None:
        return
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"workspace: expected a torch.Tensor or None, got {type(workspace).__name__}")
    if workspace.dtype != torch.uint8:
        raise TypeError(f"workspace: expected dtype uint8 (bytes: indexcache.workspace_bytes), got "
                        f"{dtype_names([workspace.dtype])}")
    if workspace.device != device:
        raise ValueError(f"workspace: expected a tensor on {device}, got one on {workspace.device}")
    if workspace.dim() != 1 or not workspace.is_contiguous():
        raise ValueError(f"workspace: expected a 1-D contiguous tensor, got shape {dims(workspace.shape)} strides "
                         f"{dims(workspace.stride())}")
    if where := _misaligned(workspace):
        raise ValueError(f"workspace: expected a view that starts at a multiple of 4 bytes (kernels read it as "
                         f"int32), got {where}")
    check_output("workspace", workspace, tensors)


def check_cache(k_cache, dim_name: str, dim: int, device: torch.device,
                fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> None:
    """The packed cache (:mod:`indexcache.hal.layout`) of ``fp8_dtype`` keys of ``dim`` elements (``dim_name``'s
    last dimension): uint8, on ``device``, a page shape that fits, contiguous, scales 4-byte aligned."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.dtype != torch.uint8:
        raise TypeError(f"k_cache: expected a uint8 torch.Tensor, got {getattr(k_cache, 'dtype', type(k_cache))}")
    if k_cache.device != device:
        raise ValueError(f"k_cache: expected a tensor on {device}, got one on {k_cache.device}")
    if fp8_dtype == fp4.FP4 and (dim == 0 or dim % fp4.BLOCK):
        raise ValueError(f"{dim_name}: expected a last dimension that is a positive multiple of {fp4.BLOCK} (MXFP4 "
                         f"keys: a scale every {fp4.BLOCK} elements), got {shown(dim)}")
    if dim == 0 or dim % 4:
        raise ValueError(f"{dim_name}: expected a last dimension that is a positive multiple of 4 (the packed "
                         f"cache keeps float32 scales after each page's keys), got {shown(dim)}")
    cache_page_size(k_cache, dim, fp8_dtype)
    if not k_cache.is_contiguous():
        raise ValueError("k_cache: expected a contiguous tensor, got a strided view")
    if where := _misaligned(k_cache):
        why = ("the kernels read its keys and scales as 4-byte words" if fp8_dtype == fp4.FP4 else
               "its scales are float32")
        raise ValueError(f"k_cache: expected a view that starts at a multiple of 4 bytes ({why}), got {where}")


def check_translate_inputs(raw_shape, page_table, seq_lens, page_size, row_to_batch, device) -> None:
    """The page-table arguments of a translation of ``raw_shape [R, K]`` indices: ``page_table [B, P]``,
    ``seq_lens [R]`` and ``row_to_batch [R]`` (or None) int32 on ``device``, ``page_size`` in range."""
    rows = raw_shape[0]
    check_tensor("page_table", page_table, (INDEX,), (None, None), device)
    check_tensor("seq_lens", seq_lens, (INDEX,), (rows,), device)
    check_page_size(page_size)
    if row_to_batch is not None:
        check_tensor("row_to_batch", row_to_batch, (INDEX,), (rows,), device)
