#!/usr/bin/env bash
# Device call (#18 Build 2, session 11, 1): PDL / no finish / 2 sample rounds raced beside DG+FI; the graph test with
# PDL launches; paged_topk_translate conformance; indexcache bench --op paged_topk_translate.
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
PYTHONPATH=/tmp/site COMMIT=$1 timeout 170 python3 .peers/pdl.py > $OUT/pdl.log 2>&1
echo "race rc=$? $((SECONDS-T0))s"; grep -v "^ *\[\|^ *[0-9]\|^ *\]\|true\|false" $OUT/pdl.log | tail -60; T0=$SECONDS
timeout 120 indexcache bench --op paged_topk_translate --json $OUT/bench-paged_topk_translate.json > $OUT/bench.log 2>&1
echo "bench rc=$? $((SECONDS-T0))s"; tail -9 $OUT/bench.log; T0=$SECONDS
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_compile.py::test_every_op_compiles_on_the_gpu_and_equals_eager > $OUT/graph.log 2>&1
echo "graph rc=$? $((SECONDS-T0))s"; tail -3 $OUT/graph.log; T0=$SECONDS
INDEXCACHE_CONFORMANCE_BACKENDS=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/conformance -k "paged_topk_translate or (topk_translate and cuda)" > $OUT/conf.log 2>&1
echo "conf rc=$? $((SECONDS-T0))s"; tail -3 $OUT/conf.log
