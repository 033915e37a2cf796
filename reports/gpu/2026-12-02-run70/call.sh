#!/usr/bin/env bash
# Device call (#18, session 12, 3): main decode (one-read schedule, fill flag) vs 3d66a0b and a precomputed schedule; test_decode_sm90.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peers/wheels/*.whl > $OUT/pip.log 2>&1 || echo "wheels failed"
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NVLIBS=$(ls -d "$SITE"/nvidia/*/lib "$SITE"/nvidia/cu13/lib 2>/dev/null | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH=${NVLIBS}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; else export CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); fi
export DG_JIT_CACHE_DIR=/tmp/dg-jit
( cd .peers/topk && python3 build.py > $OUT/build.log 2>&1; echo "build rc=$?" )
PYTHONPATH=/tmp/site COMMIT=$1 VARIED=1 timeout 300 python3 .peers/sched_ab2.py > $OUT/sched_ab2.log 2>&1
echo "sched_ab2 rc=$?"; cut -c1-1500 $OUT/sched_ab2.log | tail -8
