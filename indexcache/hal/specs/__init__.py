"""One spec record per op (:class:`~indexcache.hal.specs.base.OpSpec`): its checks, float64 reference, judge
rule, conformance cases and benchmark definition (:class:`~indexcache.hal.specs.bench.BenchSpec`), each op in
its own module. Adding a case to an op touches that op's module."""

from indexcache.hal.specs import (
    mqa_logits,
    paged_mqa_logits,
    paged_topk_translate,
    quantize_index_k,
    store_index_k,
    topk,
    topk_translate,
    translate,
)
from indexcache.hal.specs.base import OpSpec

# The catalogue, in order.
SPECS: dict[str, OpSpec] = {m.SPEC.name: m.SPEC for m in (
    translate, topk, topk_translate, mqa_logits, paged_mqa_logits, paged_topk_translate, quantize_index_k,
    store_index_k)}
