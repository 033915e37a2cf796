#!/usr/bin/env bash
# Device call (#18 Build 2, session 11, 3): PDL race (all / top-k only / none) beside DG+FI, in 4-call and 1-call graphs;
# indexcache bench --op paged_topk_translate; the top-k peers harness (Build 1 rows); ci/gpu.sh core.
set -u
export PYTHONUNBUFFERED=1
T0=$SECONDS
export INDEXCACHE_COMMIT=$1
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -2
GPU_SH_PARTS=core GPU_SH_BUDGET=${BUDGET:-300} timeout $(( ${BUDGET:-300} + 30 )) bash ci/gpu.sh > $OUT/gpu-sh.log 2>&1
echo "gpu.sh rc=$? $((SECONDS-T0))s"; grep -E "^(=== |ok|FAILED|TIMED|step)" $OUT/gpu-sh.log | tail -30; tail -15 $OUT/gpu-sh.log | cut -c1-200
