"""The float64 / int64 oracle every backend is judged against: short, obviously right, slow.

Each op's reference lives in its spec record (:mod:`indexcache.hal.specs`), next to its checks and judge
rule; these are those functions. They run on the CPU (inputs are copied there first), loop over rows where
that makes the rule plain, and return int32 indices (-1 for an empty slot) or float64 logits.
"""

from indexcache.hal.specs import SPECS

translate = SPECS["translate"].reference
topk = SPECS["topk"].reference
topk_translate = SPECS["topk_translate"].reference
mqa_logits = SPECS["mqa_logits"].reference
paged_mqa_logits = SPECS["paged_mqa_logits"].reference
paged_topk_translate = SPECS["paged_topk_translate"].reference
quantize_index_k = SPECS["quantize_index_k"].reference
store_index_k = SPECS["store_index_k"].reference
