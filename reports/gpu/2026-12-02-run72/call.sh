#!/usr/bin/env bash
# Device call (#18, session 12, 5): the finishing launch's trigger A/B (fin_ab.py), then ci/gpu.sh core on HEAD.
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
PYTHONPATH=/tmp/site COMMIT=$1 timeout 100 python3 .peers/fin_ab.py > $OUT/fin_ab.log 2>&1
echo "fin_ab rc=$? $((SECONDS-T0))s"; grep -v "^ " $OUT/fin_ab.log | cut -c1-900 | tail -4; T0=$SECONDS
mkdir -p $OUT/gpu
OUT=$OUT/gpu GPU_SH_PARTS=core GPU_SH_BUDGET=${BUDGET:-400} bash ci/gpu.sh > /dev/null 2>&1; echo "gpu.sh rc=$? $((SECONDS-T0))s"
cat $OUT/gpu/summary.txt
