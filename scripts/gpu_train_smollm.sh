#!/usr/bin/env bash
# Train the SmolLM2-135M DFlash drafter on a GPU machine without internet access.
#
# The GGUF (98.4 MB) is larger than what one transfer to such a machine may carry
# (64 MiB including the working tree, whose two shipped drafters take ~50 MB), so it
# travels in parts of at most PART_BYTES (default 12 MB: nine parts, aa to ai), in calls
# run back to back:
#
#   here, once:   bash scripts/gpu_train_smollm.sh --prepare
#                   -> .smol/gguf.part-aa, -ab, ... (parts of the GGUF) and
#                      .whl/gguf-*.whl; both folders are added to .git/info/exclude
#   GPU calls 1 to N-1: bash scripts/gpu_train_smollm.sh  (carry .smol/gguf.part-aa, then
#                      -ab, ...)
#                   -> stores the part in $SMOL_STAGE (default /root/smol); while parts are
#                      missing, runs the trainer for 20 steps on the repo's tiny random
#                      target as a CUDA smoke test (~30 s; SMOKE=0 skips it) and exits
#   GPU call N:   bash scripts/gpu_train_smollm.sh [ARGS]   (carry the last part and .whl)
#                   -> joins and checks the GGUF (sha256), installs gguf if missing,
#                      converts, trains (python3 -m scripts.train_drafter --max-minutes
#                      ${MAX_MINUTES:-8.5} ARGS; --dspark for the DSpark drafter) and writes
#                      $OUT/drafter/ and $OUT/train.log;
#                      CONVERT_ONLY=1: converts the target to $SMOL_STAGE/hf and stops there
#
# model.safetensors (~23 MB) comes back split into 15 MiB parts (a returned file may not
# exceed 16 MiB); rebuild it with: cat model.safetensors.part-* > model.safetensors
# (model.safetensors.sha256 checks it).  A machine given back between two calls loses
# the parts stashed so far: the last call then says so; run them all again.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_SIZE=98362432
PY=${PYTHON:-python3}

if [[ "${1:-}" == "--prepare" ]]; then
    src=$($PY -c "from vllm_ddtree.demo.smollm import find_gguf; print(find_gguf())")
    mkdir -p .smol .whl
    rm -f .smol/gguf.part-*
    split -b "${PART_BYTES:-12000000}" -a 2 "$src" .smol/gguf.part-  # part-aa, -ab, ...
    ls .whl/gguf-*.whl >/dev/null 2>&1 || $PY -m pip download -q --no-deps -d .whl "gguf==0.19.0"
    for d in /.smol/ /.whl/; do
        grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
    done
    ls -l .smol .whl
    exit 0
fi

STAGE=${SMOL_STAGE:-/root/smol}
OUT=${OUT:-$PWD/out}
mkdir -p "$STAGE" "$OUT"
for p in .smol/gguf.part-*; do
    [[ -f "$p" ]] && cp "$p" "$STAGE/"
done
GGUF="$STAGE/$GGUF_NAME"
if [[ ! -f "$GGUF" ]] || [[ $(stat -c %s "$GGUF") != "$GGUF_SIZE" ]]; then
    have=$(cat "$STAGE"/gguf.part-* 2>/dev/null | wc -c)
    if [[ "$have" != "$GGUF_SIZE" ]]; then
        echo "have $have of $GGUF_SIZE GGUF bytes in $STAGE ($(ls "$STAGE" | grep -c gguf.part-)" \
             "part(s)): run again carrying the next part (.smol/gguf.part-aa, -ab, ..., back to back)"
        if [[ "${SMOKE:-1}" == 1 ]]; then
            # Meanwhile, the whole trainer on this GPU with the repo's tiny random Qwen3
            # target (no GGUF needed, ~30 s): CUDA problems show up before the real run.
            tgt=$($PY -c "from vllm_ddtree.testing.fixtures import make_tiny_pair as m; print(m('/tmp/fx', 'random', 'bfloat16')[0])")
            PYTHONUNBUFFERED=1 $PY -m scripts.train_drafter --out /tmp/smoke-drafter --target "$tgt" \
                --mask-id 259 --max-docs 200 --raw-tokens 200000 --gen-prompts 64 --gen-tokens 32 \
                --eval-prompts 16 --batch 16 --seq-len 256 --anchors 8 --steps 20 --log-every 5 \
                --max-minutes 2 2>&1 | tail -n 12
            echo "smoke exit status ${PIPESTATUS[0]}"
        fi
        exit 0
    fi
    cat "$STAGE"/gguf.part-* > "$GGUF"
fi
echo "$GGUF_SHA256  $GGUF" | sha256sum -c -

if ! $PY -c "import gguf" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/gguf-*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export VLLM_DDTREE_SMOLLM_GGUF="$GGUF" VLLM_DDTREE_SMOLLM_DIR="$STAGE/hf" PYTHONUNBUFFERED=1
if [[ "${CONVERT_ONLY:-0}" == 1 ]]; then  # the target folder only (the drafter ships)
    exec $PY -m vllm_ddtree.demo.smollm
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
set +e
$PY -m scripts.train_drafter --out "$OUT/drafter" --max-minutes "${MAX_MINUTES:-8.5}" "$@" 2>&1 \
    | grep --line-buffered -v -e "^Loading weights" -e "de-quantizing" | tee "$OUT/train.log"
rc=${PIPESTATUS[0]}
set -e
if [[ -f "$OUT/drafter/model.safetensors" ]]; then
    (cd "$OUT/drafter" && sha256sum model.safetensors > model.safetensors.sha256 \
        && split -b 15M model.safetensors model.safetensors.part- && rm model.safetensors)
fi
ls -l "$OUT" "$OUT/drafter" 2>/dev/null || true
exit "$rc"
