r"""Talk to a vLLM OpenAI-compatible server that runs DDTree.

Start a server first, e.g. the README's CPU command (the demo's SmolLM2 pair)::

    T=$(python -m vllm_ddtree.demo.smollm); D=$(python -m vllm_ddtree.demo.smollm --drafter)
    vllm-ddtree vllm serve "$T" --dtype float32 --enforce-eager --max-model-len 2048 \
        --kv-cache-memory-bytes 1G --speculative-config \
        "{\"method\": \"ddtree\", \"model\": \"$D\", \"num_speculative_tokens\": 15}"

(on a GPU: ``vllm serve MODEL --speculative-config ...``), then::

    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1

Speculative decoding changes no API: requests look exactly as without it.  The script
ends with the server's speculative-decoding counters and tau (acceptance length).
"""

from __future__ import annotations

import argparse
import re
import urllib.request

from openai import OpenAI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="served model name (default: the server's first model)")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="EMPTY")
    model = args.model or client.models.list().data[0].id
    greedy = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.0}

    comp = client.completions.create(prompt="The capital of France is", **greedy)
    print(f"completion: {comp.choices[0].text!r}")

    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Name three trees."}], **greedy)
    print(f"chat:       {chat.choices[0].message.content!r}")

    print("stream:     ", end="", flush=True)
    for chunk in client.completions.create(prompt="Once upon a time", stream=True, **greedy):
        print(chunk.choices[0].text, end="", flush=True)  # several tokens per chunk when
    print()                                               # drafts are accepted

    # Speculative-decoding counters from the server's Prometheus endpoint.
    root = args.base_url.rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(root + "/metrics", timeout=10) as r:
        text = r.read().decode()
    counts = {}
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_num_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        counts[name] = float(m.group(1)) if m else None
        print(f"{name}: {m.group(1) if m else 'n/a (no speculation on this server?)'}")
    if counts["drafts"]:  # drafts: verify steps summed over requests
        print(f"tau (acceptance length): {1 + counts['accepted_tokens'] / counts['drafts']:.2f}")


if __name__ == "__main__":
    main()
