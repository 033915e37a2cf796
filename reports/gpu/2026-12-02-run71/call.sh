#!/usr/bin/env bash
# Device call (#18, session 12, 4): per-launch breakdown beside the peers (bd.py); the block top-k's sub-phase
# profile at HEAD (phase4.py); the top-k peers harness (Build 1 rows); indexcache bench --op paged_topk_translate.
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
PYTHONPATH=/tmp/site COMMIT=$1 timeout 150 python3 .peers/bd.py > $OUT/bd.log 2>&1
echo "bd rc=$? $((SECONDS-T0))s"; grep -v "^ " $OUT/bd.log | cut -c1-900 | tail -6; T0=$SECONDS
COMMIT=$1 timeout 120 python3 .peers/phase4.py > $OUT/phase4.log 2>&1
echo "phase4 rc=$? $((SECONDS-T0))s"; tail -3 $OUT/phase4.log | cut -c1-300; T0=$SECONDS
mkdir -p $OUT/peers-topk; OUT_SAVE=$OUT
( export OUT=$OUT_SAVE/peers-topk; PROJ=. timeout 130 bash .peers/topk/run.sh > $OUT_SAVE/peers-topk.log 2>&1; echo "peers rc=$?" )
echo "peers $((SECONDS-T0))s"; tail -14 $OUT/peers-topk.log | cut -c1-220; T0=$SECONDS
timeout 90 indexcache bench --op paged_topk_translate --json $OUT/bench-paged_topk_translate.json > $OUT/bench.log 2>&1
echo "bench rc=$? $((SECONDS-T0))s"; tail -9 $OUT/bench.log | cut -c1-200
