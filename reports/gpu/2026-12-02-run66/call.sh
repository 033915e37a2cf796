#!/usr/bin/env bash
# Device call (#18 Build 2, session 11, 3): PDL race (all / top-k only / none) beside DG+FI, in 4-call and 1-call graphs;
# indexcache bench --op paged_topk_translate; the top-k peers harness (Build 1 rows); ci/gpu.sh core.
set -u
export PYTHONUNBUFFERED=1
T0=$SECONDS
export INDEXCACHE_COMMIT=$1
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peers/wheels/*.whl > $OUT/pip.log 2>&1 || echo "wheels failed"
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NVLIBS=$(ls -d "$SITE"/nvidia/*/lib "$SITE"/nvidia/cu13/lib 2>/dev/null | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH=${NVLIBS}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; else export CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); fi
export DG_JIT_CACHE_DIR=/tmp/dg-jit
( cd .peers/topk && python3 build.py > $OUT/build.log 2>&1; echo "build rc=$?" )
echo "setup $((SECONDS-T0))s"; T0=$SECONDS
PYTHONPATH=/tmp/site COMMIT=$1 timeout 120 python3 .peers/pdl2.py > $OUT/pdl2.log 2>&1
echo "race rc=$? $((SECONDS-T0))s"; tail -2 $OUT/pdl2.log | cut -c1-600; T0=$SECONDS
timeout 100 indexcache bench --op paged_topk_translate --json $OUT/bench-paged_topk_translate.json > $OUT/bench.log 2>&1
echo "bench rc=$? $((SECONDS-T0))s"; tail -9 $OUT/bench.log | cut -c1-200; T0=$SECONDS
mkdir -p $OUT/peers-topk; OUT_SAVE=$OUT
( export OUT=$OUT_SAVE/peers-topk; PROJ=. timeout 130 bash .peers/topk/run.sh > $OUT_SAVE/peers-topk.log 2>&1; echo "peers rc=$?" )
echo "peers $((SECONDS-T0))s"; tail -14 $OUT/peers-topk.log | cut -c1-220; T0=$SECONDS
