#!/usr/bin/env bash
# Device call (#18 Build 2, 4): ci/gpu.sh core on the tree, the producer step's bench, peers_gpu's producer cases.
set -u
export PYTHONUNBUFFERED=1
T0=$SECONDS
GPU_SH_PARTS=core GPU_SH_BUDGET=430 OUT=$OUT/gpu bash ci/gpu.sh > /dev/null 2>&1
echo "gpu.sh rc=$? $((SECONDS-T0))s"; cat $OUT/gpu/summary.txt; T0=$SECONDS
timeout 60 indexcache bench --op paged_topk_translate --json $OUT/bench-paged_topk_translate.json > $OUT/bench.log 2>&1
echo "bench rc=$? $((SECONDS-T0))s"; tail -8 $OUT/bench.log; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peers/wheels/*.whl > $OUT/pip.log 2>&1 || echo "wheels failed"
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NVLIBS=$(ls -d "$SITE"/nvidia/*/lib "$SITE"/nvidia/cu13/lib 2>/dev/null | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH=${NVLIBS}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; else export CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); fi
export DG_JIT_CACHE_DIR=/tmp/dg-jit
PYTHONPATH=/tmp/site timeout 90 python3 bench/peers_gpu.py --only producer --rounds 20 --out $OUT/peers-producer.json > $OUT/peers.log 2>&1
echo "peers rc=$? $((SECONDS-T0))s"; tail -4 $OUT/peers.log
