#!/usr/bin/env bash
# The GPU run, from the repository root of a CUDA machine with no network:  bash ci/gpu.sh
#
# Installs indexcache offline, then: indexcache info; the conformance suite on every backend;
# compute-sanitizer memcheck over adversarial translate cases; the CUDA-graph tests; the translate
# benchmark; and the other GPU scripts (bench/topk_gpu.py, bench/logits_gpu.py) where present.
# Every step runs even when an earlier one failed; the exit status is 1 if any failed. Output, in
# $OUT (default ./out), five files:
#   gpu.log               every step's output, the summary last
#   summary.txt           one line a step: status, exit code, seconds
#   info.json             indexcache info --json
#   bench-translate.json  indexcache bench --op translate --json
#   reports.tar.gz        conformance reports, pytest junit XML, nvidia-smi, the optional scripts' --out folders
# Settings: PYTHON (default python3); GPU_SH_BUDGET, seconds for all steps (default 470); GPU_SH_JOBS, processes
# each conformance step deals its cases to (default 8); INDEXCACHE_COMMIT, the
# commit recorded in the bench JSON where the tree has no .git; GPU_SH_PARTS, which parts to run (default "core
# kernels runtime"; one device call holds about two of them): core = conformance (sm90 and forced sm80), memcheck,
# graph tests, translate bench; kernels = indexcache bench --op for each other op of the spec records (JSON in
# reports.tar.gz under bench/), the top-k and logits GPU scripts, the two-stream race of the top-k ops
# (bench/streams_race_gpu.py, and a few iterations of it under racecheck); runtime = the stream/runtime/model GPU
# tests (and under compute-sanitizer), the end-to-end and context-parallel scripts; peers = bench/peers_gpu.py, ours
# beside DeepGEMM / FlashInfer / SGLang where they import
# (not in the default parts; PEER_WHEELS, a folder of peer wheels such as sgl-deep-gemm 0.1.2 and apache-tvm-ffi
# 0.1.9, installs them into a folder of their own first); GPU_SH_SKIP, names of steps to leave out (e.g.
# "logits-gpu").
# The core part starts with indexcache warmup (the DeepSeek-V3.2 example config's kernel variants, compiled in
# parallel). coldstart = bench/coldstart_gpu.py: the serving sweep's compiles and first calls, cold and after
# indexcache warmup, and DeepGEMM's JIT where it imports (after peers when both run); not in the default parts (about
# five minutes).
set -u
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
PY=${PYTHON:-python3}
BUDGET=${GPU_SH_BUDGET:-470}
mkdir -p "${OUT:=./out}"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
SITE=$(mktemp -d)
LOG=$OUT/gpu.log
SUMMARY=$OUT/summary.txt
: >"$LOG"
: >"$SUMMARY"
START=$SECONDS
FAILED=0

say() { echo "$*" | tee -a "$LOG"; }

# record NAME STATUS RC SECONDS: one summary line; any status but ok / absent / fell back marks the run failed.
record() {
  printf '%-22s %-34s rc=%-4s %ss\n' "$1" "$2" "$3" "$4" >>"$SUMMARY"
  case $2 in ok* | absent* | "fell back"*) ;; *) FAILED=1 ;; esac
}

# step NAME LIMIT CMD...: run CMD (an executable, not a shell function), output to the console and the log,
# killed after LIMIT seconds or when the budget runs out. ON_FAIL names the status of a failure (default FAILED).
step() {
  local name=$1 limit=$2 left rc t0 status=ok
  shift 2
  if [[ " ${GPU_SH_SKIP:-} " == *" $name "* ]]; then
    say "=== $name: skipped (GPU_SH_SKIP)"
    record "$name" "absent (GPU_SH_SKIP)" - 0
    return 0
  fi
  left=$((BUDGET - (SECONDS - START)))
  if ((left < 20)); then
    say "=== $name: not run, the ${BUDGET}s budget is spent"
    record "$name" "NOT RUN (budget spent)" - 0
    return 1
  fi
  ((limit > left)) && limit=$left
  say "=== $name (limit ${limit}s): $*"
  t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if ((rc == 124 || rc == 137)); then status="TIMED OUT"; elif ((rc != 0)); then status=${ON_FAIL:-FAILED}; fi
  record "$name" "$status" "$rc" $((SECONDS - t0))
  return "$rc"
}

say "=== gpu.sh $(date -u +%FT%TZ) in $(pwd); commit ${INDEXCACHE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
step nvidia-smi 30 bash -c 'nvidia-smi >"$0"; rc=$?; cat "$0"; exit $rc' "$WORK/nvidia-smi.txt"
step python 60 "$PY" -c 'import sys, torch, triton; print(sys.version); print("torch", torch.__version__, "cuda",
torch.version.cuda, "gpu", torch.cuda.is_available() and torch.cuda.get_device_name()); print("triton", triton.__version__)'

# Install without network: editable first; where that fails, a plain install into a folder of its own; where
# building fails too, that folder gets the sources linked in place (indexcache/ with backends/ inside, as the
# package-dir mapping of pyproject.toml has it). With a folder, PYTHONSAFEPATH keeps the checkout's indexcache/
# (which lacks backends/) from shadowing it.
IMPORT_CHECK='import indexcache, indexcache.backends.torch, indexcache.tools.cli; print("indexcache from", indexcache.__file__)'
if ON_FAIL="fell back" step install-editable 180 "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . \
  && ON_FAIL="fell back" step import-check 60 "$PY" -c "$IMPORT_CHECK"; then
  :
else
  say "=== editable install unusable: installing into $SITE instead"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1
  if ! ON_FAIL="fell back" step install-target 180 "$PY" -m pip install --no-build-isolation --no-deps --no-index \
    --target "$SITE" .; then
    say "=== building failed: linking the sources into $SITE"
    rm -rf "${SITE:?}"/* && cp -rs "$PWD/indexcache" "$SITE/indexcache" && ln -s "$PWD/backends" "$SITE/indexcache/backends"
  fi
  step import-check-folder 60 "$PY" -c "$IMPORT_CHECK"
fi

IC=("$PY" -m indexcache.tools.cli)
step info 60 bash -c '"$@" info --json >"$0"; rc=$?; cat "$0"; exit $rc' "$OUT/info.json" "${IC[@]}"
PARTS=" ${GPU_SH_PARTS:-core kernels runtime} "
part() { [[ $PARTS == *" $1 "* ]]; }

run_hook() {  # run_hook NAME LIMIT: bench/NAME_gpu.py --out WORK/NAME, when the script exists
  if [[ -f bench/$1_gpu.py ]]; then
    step "$1-gpu" "$2" "$PY" "bench/$1_gpu.py" --out "$WORK/$1"
  else
    record "$1-gpu" "absent (bench/$1_gpu.py)" - 0
  fi
}

if part core; then
# Every Triton kernel variant a DeepSeek-V3.2 deployment can launch on this GPU, compiled in parallel over the cores
# into Triton's cache (docs/kernels.md, "Kernel variants"): the step's time is that deployment's warmup. The
# conformance cases, at other heads, k and page sizes, still compile most of theirs: each backend's cases are dealt
# to JOBS processes (default 8) so that they compile side by side (one process took 146 s and 155 s cold on the H200).
JOBS=${GPU_SH_JOBS:-8}
step warmup 120 "${IC[@]}" warmup --config examples/configs/deepseek-v3.2.json
# The default backends: those available on this machine (cuda and torch, compiled); CI interprets the rest.
step conformance 240 "${IC[@]}" conformance --jobs "$JOBS" --out "$WORK/reports"
# The A100 (sm80) path forced on this GPU: fp8 read as bytes and decoded to fp16 before an fp16 mma.sync,
# quantize/store encoding e4m3 bytes with bit arithmetic; its own report folder.
step conformance-sm80 240 env INDEXCACHE_CUDA_ARCH=sm80 "${IC[@]}" conformance --backend cuda --jobs "$JOBS" \
  --out "$WORK/reports-sm80"

if SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null); then
  # PYTORCH_NO_CUDA_MEMORY_CACHING=1: each tensor its own cudaMalloc, so a read past a tensor's end is outside
  # every allocation (with the caching allocator it stays inside a cached segment and memcheck cannot see it).
  step memcheck 200 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool memcheck --error-exitcode 1 \
    "$PY" ci/memcheck_translate.py
  # Every conformance case of the cuda backend (top-k, logits, quantize/store included) under memcheck.
  step memcheck-conformance 240 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool memcheck --error-exitcode 1 \
    "$PY" -m indexcache.conformance.worker --backend cuda --out "$WORK/memcheck-reports"
else
  say "=== memcheck: compute-sanitizer not found"
  record memcheck "FAILED (no compute-sanitizer)" - 0
fi

# The graph tests (translate, gather_index_k, the prefill producer step), every op compiled (aot_eager, inductor) and
# captured on the cuda backend, and the workspace's two-stream and captured-graph tests.
step graph-tests 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_translate_graph.py tests/test_gather_graph.py \
  tests/test_prefill_producer.py tests/test_compile.py::test_every_op_compiles_on_the_gpu_and_equals_eager tests/test_workspace.py \
  --junitxml "$WORK/graph-tests.xml"
# On a GPU these tests must run: a skip there would hide the check, so it counts as a failure.
step graph-tests-ran 30 "$PY" -c 'import sys, xml.etree.ElementTree as E
s = sum(int(x.get("skipped", 0)) for x in E.parse(sys.argv[1]).getroot().iter("testsuite"))
print(f"{s} graph tests skipped on the GPU"); sys.exit(s > 0)' "$WORK/graph-tests.xml"

# The Hopper decode kernel in Gluon (the sm90 default with Triton 3.6) against the Triton kernel, bit for bit.
step decode-sm90-tests 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_decode_sm90.py
step prefill-sm90-tests 200 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_prefill_sm90.py
# The Gluon block top-k: which rows it finishes itself (the others take the finishing launch's exact fallback), and
# the same index sets under each BLOCK_SMEM (two more variants to build than the table's).
step topk-block-tests 160 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_topk_block.py

step bench-translate 200 "${IC[@]}" bench --op translate --json "$OUT/bench-translate.json"
run_hook launch_overhead 150

fi

if part kernels; then
  # indexcache bench for every op but translate (core benches it), each well under a minute on an H200; JSON under
  # $WORK/bench (reports.tar.gz: $OUT keeps at most 8 files).
  for op in $("$PY" -c 'from indexcache.hal.specs import OP_NAMES; print(*(o for o in OP_NAMES if o != "translate"))'); do
    step "bench-$op" 120 "${IC[@]}" bench --op "$op" --json "$WORK/bench/bench-$op.json"
  done
  run_hook topk 240
  run_hook logits 240
  # Two streams calling the three top-k ops at once, 1000 iterations, each result equal to
  # the one-stream one; the producer step timed on the default workspace against a caller's. Then a few iterations
  # under racecheck (shared-memory hazards inside the kernels; the streams' sharing is what the exact check sees).
  run_hook streams_race 240
  if SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)}
  then
    # The Gluon warp-specialized decode is left out: racecheck reports Triton's own warp-specialization hand-off
    # (state bytes ordered by a whole-block bar.sync it does not credit; docs/experiments.md, "Correctness on the
    # GPU"), which bench/racecheck_ws_gpu.py reproduces on the smallest such kernel.
    step streams-race-racecheck 240 "$SANITIZER" --tool racecheck --error-exitcode 1 \
      --kernel-name-exclude kns=paged_decode_sm90_kernel "$PY" bench/streams_race_gpu.py \
      --iters 2 --no-timing --out "$WORK/streams_race_racecheck"
  else
    record streams-race-racecheck "FAILED (no compute-sanitizer)" - 0
  fi
fi

if part runtime; then
  step runtime-gpu-tests 150 env INDEXCACHE_GRAPH_REPLAYS=1000 "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/test_streams.py tests/test_runtime.py tests/test_model.py --junitxml "$WORK/runtime-tests.xml"
  run_hook e2e 180
  run_hook cp 120
  run_hook cp_model 120
  # The captured decode step of the small model and the runner's captured layers, under memcheck and racecheck
  # (with the caching allocator: graph capture allocates from its private pool); last, being the slowest.
  if [[ -n ${SANITIZER:-} ]]; then
    for tool in memcheck racecheck; do
      step "$tool-graphs" 240 env INDEXCACHE_GRAPH_REPLAYS=20 "$SANITIZER" --tool "$tool" --error-exitcode 1 \
        "$PY" -m pytest -q -p no:cacheprovider tests/test_model.py tests/test_runtime.py -k captured
    done
  fi
fi

if part peers; then
  if [[ -n ${PEER_WHEELS:-} ]]; then
    # Peers install beside, never into, the environment: a folder of their own on PYTHONPATH. DeepGEMM loads the
    # CUDA libraries torch's wheels bring (nvrtc among them) and compiles its kernels with the machine's nvcc.
    PEER_SITE=$(mktemp -d)
    step peers-install 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$PEER_SITE" \
      "$PEER_WHEELS"/*.whl
    export PYTHONPATH=$PEER_SITE${PYTHONPATH:+:$PYTHONPATH}
    PURELIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    for lib in "$PURELIB"/nvidia/*/lib "$PURELIB"/nvidia/cu13/lib /usr/local/cuda/lib64; do
      [[ -d $lib ]] && LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    done
    export LD_LIBRARY_PATH
    [[ -z ${CUDA_HOME:-} && -x /usr/local/cuda/bin/nvcc ]] && export CUDA_HOME=/usr/local/cuda
    DG_JIT_CACHE_DIR=$(mktemp -d); export DG_JIT_CACHE_DIR
  fi
  run_hook peers 420
fi

if part coldstart; then  # fresh Triton and DeepGEMM caches of its own
  run_hook coldstart 540
fi

tar -czf "$OUT/reports.tar.gz" -C "$WORK" . || record pack "FAILED (tar)" - 0
if (($(stat -c %s "$LOG") > 15 * 1024 * 1024)); then  # files over 16 MiB do not come back: keep both ends
  { head -c 4M "$LOG"; printf '\n[... gpu.sh cut the middle of this log ...]\n'; tail -c 10M "$LOG"; } >"$LOG.cut"
  mv "$LOG.cut" "$LOG"
fi
say "=== summary ($((SECONDS - START))s; reports.tar.gz holds: $(cd "$WORK" && find . -type f | sort | tr '\n' ' '))"
tee -a "$LOG" <"$SUMMARY"
if ((FAILED)); then say "gpu.sh: some steps failed"; else say "gpu.sh: all steps ok"; fi
exit "$FAILED"
