"""HiSparse in Triton (docs/hisparse.md): one step's plan on the device (:mod:`.plan`) and the swap-in of a plan's
copies (:mod:`.swap`). What other modules use: the ops and compile specs (``KERNEL_MODULES``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from indexcache.backends.triton.hisparse import plan, swap
from indexcache.backends.triton.launcher import bound
from indexcache.backends.triton.support import on_target_device
from indexcache.backends.triton.target import Target
from indexcache.hal.contract import OpImpl

__all__ = ["compile_specs", "ops"]


def _plan_op(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> OpImpl:
    cfg = tuning["hisparse_plan"]
    options = plan.plan_options(target, cfg)

    def args_of(row_to_batch=None, host_rows=None, slot_index=None, **args):
        return dict(args, row_to_batch=row_to_batch, host_rows=host_rows, slot_index=slot_index)

    def supports(**args):
        a = args_of(**args)
        tensors = {n: a[n] for n in ("raw", "seq_lens", "host_loc", "slot_token", "slot_age", "row_to_batch",
                                     "slot_index", "out", "out_copy_src", "out_copy_dst", "out_copy_count")}
        return on_target_device(target, **tensors) + plan.supports(**a)

    def run(**args):
        a = args_of(**args)
        launch = plan.plan_launch(**a, target=target, cfg=cfg, options=options)
        if launch is not None:
            launch()
        return a["out"], a["out_copy_src"], a["out_copy_dst"], a["out_copy_count"]

    def prepare(**args):
        return bound([plan.plan_launch(**args_of(**args), target=target, cfg=cfg, options=options)])

    return OpImpl(run, supports, prepare)


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """The HiSparse ops of a GPU backend built for ``target`` with its tuning table."""
    return {"hisparse_plan": _plan_op(target, tuning), **swap.ops(target, tuning)}


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """Every HiSparse kernel variant the cross-compile check builds for ``target``."""
    return plan.compile_specs(target, tuning) + swap.compile_specs(target, tuning)
