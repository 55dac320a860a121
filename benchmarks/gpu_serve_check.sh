#!/usr/bin/env bash
# `vllm serve` with DDTree on the GPU machine (CUDA graphs on), against the same target
# served without speculation: greedy token ids of a few completions (one batched request
# and single ones) must be identical; prints the spec-decode metrics.  The summary goes to
# OUT_DIR/result.txt and is printed last.  The reference server runs eager (PLAIN_EAGER=0:
# with CUDA graphs too): it only gives the tokens, and skips ~40 s of compilation.
#   bash benchmarks/gpu_serve_check.sh OUT_DIR [BUDGET [EXTRA SERVE ARGS...]]
#   (e.g. --tensor-parallel-size 2)
# (CPU check of the script: SERVE="python -m vllm.entrypoints.openai.api_server --model")
set -u
SERVE=${SERVE:-python3 -m vllm.entrypoints.cli.main serve}
OUT=${1:-/tmp/serve-check}; B=${2:-60}; EXTRA=("${@:3}"); mkdir -p "$OUT"
read -r T D < <(python3 -c "
from vllm_ddtree.testing.fixtures import make_tiny_pair
t, d = make_tiny_pair('$OUT/fx', 'tree_beats_chain', 'bfloat16'); print(t, d)")
serve() {  # port log [extra args...]
  local port=$1 log=$2; shift 2
  $SERVE "$T" --port "$port" --max-model-len 512 \
    --gpu-memory-utilization 0.2 --max-num-seqs 8 --served-model-name tiny "${EXTRA[@]}" "$@" > "$log" 2>&1 &
}
up() { for _ in $(seq 1 180); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 1; done
       echo "server on port $1 did not come up"; return 1; }
PLAIN_ARGS=(); [ "${PLAIN_EAGER:-1}" = 1 ] && PLAIN_ARGS=(--enforce-eager)
serve 8012 "$OUT/plain.log" "${PLAIN_ARGS[@]}"; PLAIN=$!
up 8012   # one at a time: vLLM's memory profiling must not see the other start
serve 8011 "$OUT/server.log" --speculative-config \
  "{\"method\":\"ddtree\",\"model\":\"$D\",\"num_speculative_tokens\":$B}"; SPEC=$!
up 8011
python3 - > "$OUT/result.txt" 2>&1 <<'PY'
import json, urllib.request

def post(port, body):
    req = urllib.request.Request(f"http://localhost:{port}/v1/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))

def ids(port, prompt, n):
    r = post(port, {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True})
    return [c["token_ids"] for c in sorted(r["choices"], key=lambda c: c["index"])]

cases = [("hello world", 64), (["a b c", "tree", "x" * 40, "the quick brown fox"], 96)]
same = total = 0
for prompt, n in cases:
    a, b = ids(8011, prompt, n), ids(8012, prompt, n)
    same += sum(x == y for x, y in zip(a, b)); total += len(b)
print(f"vllm serve ddtree vs no speculation: {same}/{total} completions token-identical")
m = urllib.request.urlopen("http://localhost:8011/metrics").read().decode()
c = {l.split()[0]: float(l.split()[1]) for l in m.splitlines()
     if l.startswith("vllm:spec_decode_num") and "_per_pos" not in l and "_created" not in l}
print("metrics:", c)
d = sum(v for k, v in c.items() if k.startswith("vllm:spec_decode_num_drafts"))
a = sum(v for k, v in c.items() if k.startswith("vllm:spec_decode_num_accepted_tokens"))
print(f"tau = {1 + a / max(d, 1):.2f}")
PY
{ grep -m1 -o "KV compaction.\{0,100\}" "$OUT/server.log"
  grep -m2 -o "Graph capturing finished.*" "$OUT/server.log"; } >> "$OUT/result.txt"
kill $SPEC $PLAIN; wait 2>/dev/null
echo "=== serve check result"; cat "$OUT/result.txt"
