#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -1
timeout 100 python3 .peers/benchdiag.py 2>&1 | tail -2
echo "diag $((SECONDS-T0))s"; T0=$SECONDS
timeout 120 indexcache bench --op paged_topk_translate --json $OUT/bench-paged_topk_translate.json > $OUT/bench.log 2>&1
echo "bench rc=$? $((SECONDS-T0))s"; tail -9 $OUT/bench.log; T0=$SECONDS
timeout 100 python3 .peers/phase2.py > $OUT/phase.log 2>&1
echo "phase rc=$? $((SECONDS-T0))s"; grep case $OUT/phase.log | cut -c1-330; T0=$SECONDS
[ "${CONF:-0}" = 1 ] && INDEXCACHE_CONFORMANCE_BACKENDS=cuda timeout 110 python3 -m pytest -q -p no:cacheprovider tests/conformance -k "topk and cuda" > $OUT/conf.log 2>&1
echo "conf rc=$? $((SECONDS-T0))s"; tail -2 $OUT/conf.log
