#!/usr/bin/env bash
# `vllm serve` with DDTree on the GPU machine (CUDA graphs on): start, one greedy completion
# compared with the target alone (no speculation) through the same server API, metrics.
#   bash benchmarks/gpu_serve_check.sh OUT_DIR
set -u
OUT=${1:-/tmp/serve-check}; mkdir -p "$OUT"
read -r T D < <(python3 -c "
from vllm_ddtree.fixtures import make_tiny_pair
t, d = make_tiny_pair('$OUT/fx', 'tree_beats_chain', 'bfloat16'); print(t, d)")
python3 -m vllm.entrypoints.cli.main serve "$T" --port 8011 --max-model-len 512 \
  --gpu-memory-utilization 0.3 --max-num-seqs 8 \
  --speculative-config "{\"method\":\"ddtree\",\"model\":\"$D\",\"num_speculative_tokens\":60}" \
  > "$OUT/server.log" 2>&1 &
PID=$!
for i in $(seq 1 150); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
python3 - "$T" <<'PY'
import json, sys, urllib.request
def post(body):
    req = urllib.request.Request("http://localhost:8011/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60))
r = post({"model": sys.argv[1], "prompt": "hello world", "max_tokens": 32, "temperature": 0})
print("completion:", repr(r["choices"][0]["text"]), r["usage"])
m = urllib.request.urlopen("http://localhost:8011/metrics").read().decode()
print("\n".join(l for l in m.splitlines() if l.startswith("vllm:spec_decode_num")))
PY
grep -m1 "KV compaction" "$OUT/server.log"; grep -m1 -i "cuda graph" "$OUT/server.log"
kill $PID; wait $PID 2>/dev/null
