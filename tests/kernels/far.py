"""Views past 2^31 elements for the kernels' offset tests: gigabytes of virtual memory, kilobytes resident."""

from __future__ import annotations

import math

import torch


def far(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` copied into a view whose dimension ``dim`` steps ``2^32 / size`` elements, at most ``2^31 - 1`` (an int32
    stride), the others compact inside a step: the upper half of that dimension (of two: the second index, with the
    others' offsets) lies past 2^31 elements. One-byte dtypes (fp8, MXFP4) are copied as their bytes."""
    rest = [size for i, size in enumerate(x.shape) if i != dim]
    strides = list(torch.empty(rest, device="meta").stride())
    step = max(min(2**32 // x.shape[dim], 2**31 - 1), math.prod(rest))
    strides.insert(dim, step)
    byte = x.element_size() == 1
    base = torch.empty((x.shape[dim] - 1) * step + math.prod(rest), dtype=torch.uint8 if byte else x.dtype)
    view = base.view(x.dtype).as_strided(x.shape, strides)
    if byte:
        view.view(torch.uint8).copy_(x.view(torch.uint8))
    else:
        view.copy_(x)
    return view
