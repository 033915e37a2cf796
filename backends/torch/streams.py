"""The torch backend's ``overlap`` scheduler: the two functions in order on the current stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

S = TypeVar("S")
M = TypeVar("M")


def in_order(side_fn: Callable[[], S], main_fn: Callable[[], M], side: int, device: torch.device,
             side_sms: int | None = None, tokens: int | None = None, context: int | None = None,
             k_format: torch.dtype | None = None) -> tuple[S, M]:
    """The sequential scheduler: ``side_fn`` then ``main_fn`` on the current stream (nothing to share: the SM budget,
    the shape and the key format are not used)."""
    side_out = side_fn()
    return side_out, main_fn()
