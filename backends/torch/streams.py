"""The torch backend's ``overlap`` scheduler: the two functions in order on the current stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from indexcache.hal.contract import IN_ORDER, Schedule, side_then_main

S = TypeVar("S")
M = TypeVar("M")


def in_order(side_fn: Callable[[], S], main_fn: Callable[[], M], side: int, device: torch.device,
             side_sms: int | None = None, tokens: int | None = None, context: int | None = None,
             k_format: torch.dtype | None = None) -> tuple[S, M]:
    """The sequential scheduler: ``side_fn`` then ``main_fn`` on the current stream (nothing to share: the SM budget,
    the shape and the key format are not used)."""
    return side_then_main(side_fn, main_fn)


def in_order_schedule(side: int, device: torch.device, side_sms: int | None = None, tokens: int | None = None,
                      context: int | None = None, k_format: torch.dtype | None = None) -> Schedule:
    """:func:`in_order`'s schedule (``overlap``'s ``prepare``): the two in order, whatever the arguments."""
    return IN_ORDER
