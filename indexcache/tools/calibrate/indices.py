"""Top-k index arrays as the calibration reads them: ``[rows, k]`` integer numpy arrays, one per sparse layer.

A layer's indices come as numpy or torch (:data:`IndexArray`), any integer dtype, leading dimensions beyond two
flattened into rows; ``-1`` marks an empty slot. :func:`as_rows` takes one in, :func:`check_shapes` checks that every
layer holds the same rows with the same k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from indexcache.tools.calibrate.errors import CalibrationError

IndexArray = np.ndarray | torch.Tensor


def as_rows(value: IndexArray, what: str, error: type[ValueError] = CalibrationError) -> np.ndarray:
    """``value`` as a ``[rows, k]`` integer numpy array (leading dimensions flattened, no copy if possible).

    uint64 becomes int64 when every value fits (other integer dtypes mix with int64 exactly); problems
    raise ``error`` naming ``what``.
    """
    if isinstance(value, torch.Tensor):
        kind = ("meta" if value.is_meta else "quantized" if value.is_quantized else
                None if value.layout == torch.strided else str(value.layout).removeprefix("torch."))
        if kind:
            raise error(f"{what}: a {kind} tensor; top-k indices must be a dense integer tensor (int32)")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise error(f"{what}: dtype {value.dtype}; top-k indices must be integers (int32)")
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if not np.issubdtype(array.dtype, np.integer):
        raise error(f"{what}: dtype {array.dtype}; top-k indices must be integers (int32)")
    if array.ndim < 2:
        raise error(f"{what}: shape {tuple(array.shape)}; expected [rows, k]")
    if array.dtype == np.uint64:
        if array.size and int(array.max()) > np.iinfo(np.int64).max:
            raise error(
                f"{what}: uint64 value {int(array.max())} is beyond int64; top-k indices are token positions "
                "(int32 preferred, -1 for an empty slot)"
            )
        array = array.astype(np.int64)
    return array.reshape(math.prod(array.shape[:-1]), array.shape[-1])


def check_shapes(
    arrays: Sequence[np.ndarray], names: Sequence[str], error: type[ValueError] = CalibrationError
) -> None:
    """Raise ``error`` unless every array of ``arrays`` (named ``names``) has the first one's shape ``[rows, k]``,
    with at least one row and ``k >= 1``."""
    shape = arrays[0].shape
    for array, name in zip(arrays, names, strict=True):
        if array.shape != shape:
            raise error(
                f"{name}: shape {array.shape}, but {names[0]} has {shape}; every layer must hold the "
                "same query rows with the same k"
            )
    if shape[0] == 0 or shape[1] == 0:
        raise error(f"{names[0]}: shape {shape}; need at least one row and k >= 1")
