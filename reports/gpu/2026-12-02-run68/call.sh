#!/usr/bin/env bash
# Device call (#18, session 11, 4): sub-phase clocks of the block top-k (phase3.py).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -2
timeout 150 python3 .peers/phase3.py > $OUT/phase3.log 2>&1
echo "phase3 rc=$?"; cat $OUT/phase3.log | cut -c1-900
