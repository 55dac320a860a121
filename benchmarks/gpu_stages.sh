#!/usr/bin/env bash
# GPU measurements on a host without a package index (one NVIDIA GPU), in stages:
#   bash benchmarks/gpu_stages.sh STAGE
# One invocation per stage; each stage needs some files copied to the host next to the
# working tree (below).  vLLM comes as a split archive, .gpu/bundle.part-00, -01, ...
# (built elsewhere; split so that each upload stays small: a call carries at most 64 MiB
# with the working tree, ~53 MB of it the tracked files), which .gpu/unpack.sh collects
# and unpacks once all parts are there; the SmolLM2 GGUF comes as .smol/gguf.part-a*
# (scripts/gpu_train_smollm.sh --prepare), the gguf wheel as .whl/.  One part per call.
# Stages that need vLLM stop at once when it is not unpacked (a host that was reset: copy
# the parts again).  Full logs go to $OUT/<stage>/, tables to stdout.  On a host with vLLM installed, run the Python commands of docs/benchmarks.md and docs/benchmarks/*.md
# directly instead.
#
#   a   with .smol/gguf.part-aa                   stash (versions, GPU name); step parts
#       at 8B shape with the one-pass and the pruned top-k (gpu_step_parts.py --topk-prune 0,1)
#   b   with each next .smol/gguf.part-*, one call each   stash
#   c   with the last .smol/gguf.part-* and .whl   convert the SmolLM2 target to
#       /root/smol/hf (TRAIN_NEW=1: also train a new drafter in the background, ~10 min,
#       holding ~110 GiB of the GPU: then no vLLM engine can start until it ends)
#   c2  with each .gpu/bundle.part-* but the last, one call each   stash
#   d1  with the last .gpu/bundle.part-*           unpack vLLM, install the plugin;
#       the step profile p1 (below): DFlash vs DDTree-15 at equal width
#   e1  (nothing)   step-part timings at 8B shape (eager and in CUDA graphs); the SmolLM2
#       pair with the shipped drafter: AR vs DFlash vs DDTree, T = 0/1, batch 1..64;
#       PAIR_METHODS (default ar,dflash,ddtree; also dflash2, ddtree-N, ddtree-auto,
#       ddtree-online: engines are alive together, each pinned to its own CPUs, and the
#       cells interleaved, so keep 3-4 per stage);
#       SKIP_PARTS=1 skips the step parts, INSTALL=1 installs the plugin first (the last
#       bundle part came with it), BUDGETS (default 15,31,63), REPEATS (timed runs per
#       cell, default 1; each adds ~15-40 s per engine), PAIR_TOKENS (output tokens per
#       request, default 128), PAIR_TEMPS (default 0,1), PAIR_TIMEOUT (default 540 s)
#   serve  (nothing)  `vllm serve` vs no speculation, T>0 distribution test
#   d2  (nothing)   the Qwen3-shaped random model, DDTree rows
#
# On a host with two GPUs: `gpu_tp.sh 2 stash` with .gpu/bundle.part-00, then -01, then
#   x2  with .gpu/bundle.part-02   unpack, install; two queues at once, one per GPU:
#       GPU 0: `vllm serve` check, margin fixtures at TP = 1 (digests; REL=1: also the
#       reliability tests); GPU 1: T>0 distribution test
# then `gpu_tp.sh 2 check` and `gpu_tp.sh 2 speed`.
#   p3 (after the bundle; INSTALL=1 on the stage that brings its last part): DFlash,
#       A/A and DDTree-15 step cost on the Qwen3-shaped random pair, interleaved and not
#       profiled (PAIR_METHODS: add @inproc to a method for an in-process engine core;
#       HOST_TIMING=1, here and in e1, with every method @inproc: host ms per step by
#       runner method, benchmarks/hosttime.py)
#   p1, p2 (after the bundle): step profile of DFlash vs DDTree-15/31/32 (Qwen3-shaped
#       random pair); both write gzipped Chrome traces with Python stacks to $OUT (read
#       them with benchmarks/trace_summary.py).
# Timing: on a freshly started host a vLLM engine start with CUDA graphs takes ~2-2.5 min
# (imports ~1 min, compile ~40 s), so two servers need > 300 s.
set -u
STAGE=$1
OUT=${OUT:-/tmp/out}; LOG=$OUT/$STAGE; mkdir -p "$LOG"
TRAIN=/root/trainout
cd "$(dirname "$0")/.."
source .gpu/unpack.sh
source benchmarks/gpu_common.sh
case $STAGE in d1|e1|d2|x2|p1|p2|p3|serve) need_bundle ;; esac
install() { install_plugin
            python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"; }
shaped_pair() {  # the Qwen3-shaped random target + drafter in $1 (once per machine)
  [ -f "$1/.done" ] || python3 -c "
from pathlib import Path
from benchmarks.gpu_random_models import gen_shaped; gen_shaped(Path('$1'))"; }
train_status() { [ -f $TRAIN/run.log ] && { banner "training log tail"; tail -n 4 $TRAIN/run.log; }; }

case $STAGE in
a|b)
  [ $STAGE = a ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  [ $STAGE = a ] && python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  SMOKE=${SMOKE:-0} bash scripts/gpu_train_smollm.sh 2>&1 | tail -n 15
  if [ $STAGE = a ]; then  # torch + Triton only (no vLLM yet): one-pass vs pruned top-k
    banner "DDTree step parts at Qwen3-8B shape, top-k one pass (0) vs pruned (1)"
    timeout 240 python3 -m benchmarks.gpu_step_parts --topk-prune 0,1 \
      --budgets 15,63 --out "$LOG/parts" > "$LOG/parts.log" 2>&1
    echo "exit $?"; grep "failed:" "$LOG/parts.log"; tail -n 14 "$LOG/parts.log"
  fi
  ;;
c)
  mkdir -p $TRAIN
  if [ "${TRAIN_NEW:-0}" = 1 ]; then
    OUT=$TRAIN MAX_MINUTES=${MAX_MINUTES:-8} setsid nohup bash scripts/gpu_train_smollm.sh \
      > $TRAIN/run.log 2>&1 < /dev/null &
    sleep 40; tail -n 8 $TRAIN/run.log
  else
    CONVERT_ONLY=1 bash scripts/gpu_train_smollm.sh 2>&1 | tail -n 3
  fi
  ;;
c2)
  train_status
  ;;
d1)  # install, then the step profile (stage p1)
  install
  PROF_S=480 bash "$0" p1
  ;;
serve)  # one GPU: serve check, then the T > 0 test (stage x2 runs both at once on two GPUs)
  train_status
  banner "vllm serve (CUDA graphs) vs no speculation"
  timeout 300 bash benchmarks/gpu_serve_check.sh "$LOG/serve" 60 > "$LOG/serve.log" 2>&1
  echo "exit $?"; sed -n '/^=== serve check result/,$p' "$LOG/serve.log"; cleanup
  banner "T > 0 distribution test (bf16)"
  watchdog 270 "$LOG/sampling.log" python3 -m benchmarks.gpu_sampling --out "$LOG/sampling"
  echo "exit $?"; grep -v "INFO\|WARNING\|it/s\]" "$LOG/sampling.log" | tail -n 40; cleanup
  train_status
  ;;
e1)
  D=vllm_ddtree/demo/assets/smollm2-135m-dflash
  if [ -f $TRAIN/run.log ]; then  # a drafter trained in stage b (TRAIN_NEW=1): return it, use it
    for _ in $(seq 1 48); do [ -f $TRAIN/drafter/model.safetensors.sha256 ] && break; sleep 5; done
    train_status
    cp -r $TRAIN/drafter "$OUT/drafter"; cp $TRAIN/train.log $TRAIN/run.log "$OUT/"
    D=/root/drafter; mkdir -p $D
    cp $TRAIN/drafter/*.json $D/ && cat $TRAIN/drafter/model.safetensors.part-* > $D/model.safetensors
  fi
  [ "${INSTALL:-0}" = 1 ] && install  # a fresh machine: the bundle came with this call
  if [ "${SKIP_PARTS:-0}" != 1 ]; then
    banner "DDTree-specific step parts at Qwen3-8B shape"
    timeout 150 python3 -m benchmarks.gpu_step_parts --out "$LOG/parts" > "$LOG/parts.log" 2>&1
    echo "exit $?"; tail -n 11 "$LOG/parts.log"
  fi
  banner "SmolLM2-135M pair: AR vs DFlash vs DDTree"
  # engines start one at a time (~1 min each, cold), then the cells run interleaved; keep
  # ~3 engines per call (PAIR_METHODS; dflash2 = a second DFlash engine, the A/A noise
  # floor) and dflash in every call to have the ratios in each run
  timeout ${PAIR_TIMEOUT:-540} python3 -m benchmarks.throughput --target /root/smol/hf --drafter $D \
    --prompts $D/training_log.json --num-prompts 64 --budgets ${BUDGETS:-15,31,63} \
    --methods "${PAIR_METHODS:-ar,dflash,ddtree}" --batches 1,2,4,8,16,32,64 --max-model-len 1024 \
    --temps ${PAIR_TEMPS:-0,1} \
    --max-num-batched-tokens 4096 --repeats ${REPEATS:-1} --max-tokens ${PAIR_TOKENS:-128} \
    $([ "${HOST_TIMING:-0}" = 1 ] && echo --host-timing) --out "$LOG/pair" > "$LOG/pair.log" 2>&1
  echo "exit $?"; sed -n '/^method/,$p' "$LOG/pair.log" | tail -n 80
  grep -E "Error|error:" "$LOG/pair.log" | tail -n 5
  ;;
d2)
  banner "Qwen3-shaped random model (DDTree rows)"
  timeout 500 python3 -m benchmarks.gpu_random_models --out "$LOG/shaped" --shaped \
    --no-dflash --budgets 15,60 > "$LOG/shaped.log" 2>&1
  echo "exit $?"; tail -n 6 "$LOG/shaped.log"
  ;;
x2)
  install; nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
  (  # GPU 0 (no pkill cleanup in here: the other queue runs vLLM too)
    export CUDA_VISIBLE_DEVICES=0
    banner "vllm serve (CUDA graphs) vs no speculation"
    timeout 300 bash benchmarks/gpu_serve_check.sh "$LOG/serve" 60 > "$LOG/serve.log" 2>&1
    echo "exit $?"; sed -n '/^=== serve check result/,$p' "$LOG/serve.log"
    banner "margin fixtures at TP = 1 (digests for the TP = 2 check)"
    watchdog 270 "$LOG/margin1.log" python3 -m benchmarks.gpu_correctness --out "$LOG/margin1" \
      --fixtures tree_beats_chain,accept_all --budgets 60 --graphs 1 --batches 1,32 --ref-eager
    echo "exit $?"; sed -n '/^fixture/,$p' "$LOG/margin1.log"
    if [ "${REL:-0}" = 1 ]; then
      banner "reliability tests on the GPU (VLLM_DDTREE_TEST_GPU=1)"
      VLLM_DDTREE_TEST_GPU=1 timeout 240 python3 -m pytest -q -p no:cacheprovider \
        tests/server/test_reliability_cpu.py -s > "$LOG/reliability.log" 2>&1
      echo "exit $?"; grep -E "^(load|preemption):|passed|failed|error" "$LOG/reliability.log" | tail -n 8
    fi
  ) > "$LOG/gpu0.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1
    banner "T > 0 distribution test (bf16)"
    watchdog 540 "$LOG/sampling.log" python3 -m benchmarks.gpu_sampling --out "$LOG/sampling"
    echo "exit $?"; grep -v "INFO\|WARNING\|it/s\]" "$LOG/sampling.log" | tail -n 40
  ) > "$LOG/gpu1.log" 2>&1 &
  wait; cat "$LOG/gpu0.log" "$LOG/gpu1.log"
  ;;
p3)  # step cost without profiler, interleaved: the Qwen3-shaped random pair (tau = 1), engines
  # out of process unless a method ends in @inproc (PAIR_METHODS, default below); pooled
  # ratios with benchmarks/pooled.py
  SH=/tmp/qwen3-2b-random; shaped_pair $SH
  [ "${INSTALL:-0}" = 1 ] && install
  timeout ${PAIR_TIMEOUT:-540} python3 -m benchmarks.throughput --target $SH/target \
    --drafter $SH/drafter --methods "${PAIR_METHODS:-dflash,dflash2,ddtree-15}" --budgets 15 \
    --batches ${PAIR_BATCHES:-1,8,32} --temps 0 --max-tokens ${PAIR_TOKENS:-128} \
    --repeats ${REPEATS:-4} --max-model-len 1024 --max-num-batched-tokens 2048 \
    $([ "${HOST_TIMING:-0}" = 1 ] && echo --host-timing) --out "$LOG/steps" > "$LOG/steps.log" 2>&1
  echo "exit $?"; sed -n '/^method/,$p' "$LOG/steps.log"
  python3 -m benchmarks.pooled "$LOG/steps/results.json"
  ;;
p1|p2)  # where the DDTree step's time goes: in-process engines under torch.profiler, the
  # Qwen3-shaped random pair (tau = 1 for every method: pure step cost); p1 = DFlash and
  # DDTree-15 (equal width: the fixed overhead), p2 = DDTree-31 and -32 (width, 33rd row)
  SH=/tmp/qwen3-2b-random; shaped_pair $SH
  if [ $STAGE = p1 ]; then M=dflash,ddtree; BUD=15; else M=ddtree; BUD=31,32; fi
  timeout ${PROF_S:-560} python3 -m benchmarks.throughput --target $SH/target --drafter $SH/drafter \
    --methods $M --budgets $BUD --batches 1,32 --temps 0 --max-tokens 128 --profile --trace \
    --max-model-len 1024 --max-num-batched-tokens 2048 --gpu-mem 0.4 --sequential --out "$LOG/prof" \
    > "$LOG/prof.log" 2>&1
  echo "exit $?"; sed -n '/^method/,$p' "$LOG/prof.log"
  ;;
*) echo "unknown stage $STAGE"; exit 2 ;;
esac
