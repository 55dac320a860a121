#!/usr/bin/env bash
# Tensor-parallel check at TP = N (2 or 8) on a multi-GPU host without a package index,
# in stages, one invocation each (vLLM as the split archive of gpu_stages.sh, copied to the
# host next to the working tree):
#
#   1  with each .gpu/bundle.part-* but the last, and .gpu/unpack.sh, one call each:
#        bash benchmarks/gpu_tp.sh N stash
#   2  with the last .gpu/bundle.part-* and .gpu/unpack.sh: bash benchmarks/gpu_tp.sh N check
#   3  with .gpu/unpack.sh: bash benchmarks/gpu_tp.sh N speed
#      (TPS=1 or TPS=N: only those rows; one TP's throughput took ~300 s on a freshly
#      started host, so give each half its own invocation)
#
# check: `vllm serve --tensor-parallel-size N` with DDTree against the same server without
#        speculation (token ids), then greedy identity against no speculation at TP = N on
#        the margin fixtures (budget 60, batches 1 and 32, CUDA graphs on; eager reference),
#        with digests of the outputs to compare with TP = 1.
# speed: the random-model near-tie check on the Qwen3-shaped model (16 / 8 heads) at TP = N,
#        then AR vs DFlash vs DDTree throughput on that pair at TP = 1 and TP = N, batch 1
#        and 32 (random drafts: this measures step cost, not acceptance).
# A vLLM server start with CUDA graphs takes ~2-2.5 min on a freshly started host: the
# serve check (two servers) gets 330 s.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0).  Logs under $OUT, tables on stdout.
set -u
N=$1; STAGE=$2
OUT=${OUT:-/tmp/out}; LOG=$OUT/tp$N-$STAGE; mkdir -p "$LOG"
cd "$(dirname "$0")/.."
source .gpu/unpack.sh
export NCCL_NVLS_ENABLE=0
# 8 query heads for TP = 8 (the default pairs have 4); harmless for TP = 2
[ "$N" -gt 4 ] && export VLLM_DDTREE_FIXTURE_HEADS=8
source benchmarks/gpu_common.sh
[ "$STAGE" = stash ] || need_bundle
# install in every vLLM stage: a host that was reset gets the bundle again, and the next
# stage runs on a fresh one
[ "$STAGE" = stash ] || install_plugin

case $STAGE in
stash) ;;
check)
  nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
  banner "vllm serve --tensor-parallel-size $N, DDTree vs no speculation"
  timeout 300 bash benchmarks/gpu_serve_check.sh "$LOG/serve" 60 --tensor-parallel-size "$N" \
    > "$LOG/serve.log" 2>&1
  echo "exit $?"; sed -n '/^=== serve check result/,$p' "$LOG/serve.log"; cleanup
  banner "margin fixtures at TP = $N (digests: compare with TP = 1, stage x2 of gpu_stages.sh)"
  watchdog 280 "$LOG/margin.log" python3 -m benchmarks.gpu_correctness --out "$LOG/margin" \
    --tp "$N" --fixtures tree_beats_chain,accept_all --budgets 60 --graphs 1 --batches 1,32 \
    --ref-eager
  echo "exit $?"; sed -n '/^fixture/,$p' "$LOG/margin.log"; cleanup
  ;;
speed)
  T=/tmp/qwen3-2b-random/target; D=/tmp/qwen3-2b-random/drafter
  [ -f /tmp/qwen3-2b-random/.done ] || python3 -c "
from pathlib import Path
from benchmarks.gpu_random_models import gen_shaped; gen_shaped(Path('/tmp/qwen3-2b-random'))"
  if [ -z "${TPS:-}" ] || [ "${TPS}" = "$N" ]; then
    banner "Qwen3-shaped random model at TP = $N (near-tie check)"
    TP=$N timeout 200 python3 -m benchmarks.gpu_random_models --out "$LOG/shaped" --shaped \
      --no-dflash --budgets 60 > "$LOG/shaped.log" 2>&1
    echo "exit $?"; grep -A4 "^model" "$LOG/shaped.log"; cleanup
  fi
  for tp in ${TPS:-1 $N}; do  # TPS=1 or TPS=$N: one half (the other GPU may be busy)
    banner "throughput, Qwen3-shaped random pair, TP = $tp"
    # --sequential: one TP engine at a time, as measured so far (several TP engines alive at
    # once, the harness's default, have not been tried)
    timeout ${TPUT_S:-330} python3 -m benchmarks.throughput --target $T --drafter $D --tp $tp \
      --budgets 32 --methods ar,dflash,ddtree --batches 1,32 --temps 0 --max-tokens 64 \
      --max-model-len 1024 --max-num-batched-tokens 2048 --sequential --out "$LOG/tp$tp" \
      > "$LOG/tp$tp.log" 2>&1
    echo "exit $?"; grep -A10 "^method" "$LOG/tp$tp.log"; cleanup
  done
  ;;
*) echo "unknown stage $STAGE"; exit 2 ;;
esac
