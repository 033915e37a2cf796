#!/usr/bin/env bash
# Device call (#18 Build 2): the fused producer step's GPU tests, conformance on cuda, then the race against
# DeepGEMM + FlashInfer.
set -u
export PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peers/wheels/*.whl > $OUT/pip.log 2>&1 || echo "wheels failed"
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NVLIBS=$(ls -d "$SITE"/nvidia/*/lib "$SITE"/nvidia/cu13/lib 2>/dev/null | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH=${NVLIBS}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; else export CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); fi
export DG_JIT_CACHE_DIR=/tmp/dg-jit
( cd .peers/topk && python3 build.py > $OUT/build.log 2>&1; echo "build rc=$?" )
echo "setup $((SECONDS-T0))s"; T0=$SECONDS
if [ "${TESTS:-1}" = 1 ]; then
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_producer.py tests/test_decode_sm90.py tests/test_topk_block.py > $OUT/tests.log 2>&1
echo "tests rc=$? $((SECONDS-T0))s"; tail -5 $OUT/tests.log; T0=$SECONDS
INDEXCACHE_CONFORMANCE_BACKENDS=cuda timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/conformance -k "paged_topk_translate or topk_translate" > $OUT/conf.log 2>&1
echo "conf rc=$? $((SECONDS-T0))s"; tail -3 $OUT/conf.log; T0=$SECONDS
fi
PYTHONPATH=/tmp/site COMMIT=$1 timeout 240 python3 .peers/fused.py > $OUT/fused.log 2>&1
echo "race rc=$? $((SECONDS-T0))s"; tail -60 $OUT/fused.log
