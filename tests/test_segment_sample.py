"""The prefill producer step's segment sample, planned on the host for an sm90 GPU (meta tensors: nothing allocated,
compiled or launched): each pass's logits launch writes the sample its top-k's sample launch reads, in a piece of the
workspace of its own, within the bound; off in the table, the sample launch reads the logits as before
(docs/kernels.md, "The segment sample")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

# Every kernel module imported now, at collection, before a test elsewhere sets TRITON_INTERPRET=1 (as test_warmup).
from indexcache.backends.cuda.tuning import tuning as cuda_tuning  # noqa: E402
from indexcache.backends.triton import crosscompile, prefill_producer, variants  # noqa: E402
from indexcache.backends.triton.launcher import planning  # noqa: E402
from indexcache.plan import LayerPlan  # noqa: E402
from indexcache.tools.warmup import prefill_calls  # noqa: E402

PLAN = LayerPlan.from_config(Path(__file__).resolve().parents[1] / "examples" / "configs" / "deepseek-v3.2.json")
LOGITS = ("mqa_logits_kernel", "prefill_sm90_kernel")


def _producer_launches(tokens: int, keys: int, segment_sample: int):
    target = crosscompile.gpu_target("cuda", "sm90")
    table = cuda_tuning("sm90")
    table = {**table, "topk": {**table["topk"], "SEGMENT_SAMPLE": segment_sample}}
    args = dict(prefill_calls(PLAN, 64, target.fp8_dtype, tokens, keys))["mqa_topk_translate"]
    with planning(132):
        found = variants.op_launches("mqa_topk_translate", args, target, table)
        scratch = prefill_producer.call_workspace_bytes(args["q"], args["k"], args["k_scale"], args["weights"],
                                                        args["topk"], args["workspace_bytes"], target=target,
                                                        tuning=table)
    return found, scratch, args["workspace_bytes"]


def _name(launch) -> str:
    return launch.launcher.__name__


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last]`` element offsets of a contiguous-rows view in its storage."""
    return t.storage_offset(), t.storage_offset() + (t.shape[0] - 1) * t.stride(0) + t.shape[1] - 1


def test_each_pass_writes_the_segment_sample_its_sample_launch_reads():
    tokens, keys = 8192, 131072
    found, scratch, bound = _producer_launches(tokens, keys, 1)
    assert scratch <= bound
    logits = [launch for launch in found if _name(launch) in LOGITS]
    samples = [launch for launch in found if _name(launch) == "topk_sample_kernel"]
    assert len(logits) == len(samples) == 3  # three passes within the 2 GiB bound
    rows = 0
    for lg, sm in zip(logits, samples, strict=True):
        assert lg.named["SAMPLE"] == 1 and lg.named["FILL"] is False
        assert sm.named["SEGMENTS"] is True and sm.named["SAMPLES"] == keys // 64
        sample = sm.args[0]  # the sample launch reads the segment sample in place of the scores
        scores = next(a for a in lg.args if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[1] == keys)
        assert sample.shape == (scores.shape[0], keys // 64) and sample.stride(1) == 1
        assert any(a is sample for a in lg.args), "the logits launch writes another tensor than the sample launch reads"
        first, last = _span(sample)
        s_first, s_last = _span(scores)
        assert last < s_first or first > s_last  # a piece of its own beside the logits
        rows += sample.shape[0]
    assert rows == tokens


def test_off_in_the_table_the_sample_launch_reads_the_logits():
    found, scratch, bound = _producer_launches(8192, 131072, 0)
    assert scratch <= bound
    logits = [launch for launch in found if _name(launch) in LOGITS]
    samples = [launch for launch in found if _name(launch) == "topk_sample_kernel"]
    assert all(lg.named["SAMPLE"] == 0 for lg in logits)
    for lg, sm in zip(logits, samples, strict=True):
        assert sm.named["SEGMENTS"] is False and any(a is sm.args[0] for a in lg.args)  # the pass's scores


def test_a_pass_whose_rows_are_not_sampled_ahead_writes_no_sample():
    """Fewer rows than BLOCK_SAMPLE_ROWS: the block kernel samples its rows itself, so no segment sample."""
    found, _, _ = _producer_launches(128, 131072, 1)
    assert [lg.named["SAMPLE"] for lg in found if _name(lg) in LOGITS] == [0]
    assert not [launch for launch in found if _name(launch) == "topk_sample_kernel"]
