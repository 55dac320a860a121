"""Talk to a vLLM OpenAI-compatible server that runs DDTree.

Start a server first, for example with the bundled tiny pair
(``python -m vllm_ddtree.testing.fixtures /tmp/ddtree-fixtures`` prints the paths)::

    P=/tmp/ddtree-fixtures/random-float32
    python -m vllm.entrypoints.openai.api_server --model $P/target \\
        --dtype float32 --enforce-eager --max-model-len 512 --port 8000 \\
        --speculative-config '{"method": "ddtree", "model": "'$P/drafter'",
                               "num_speculative_tokens": 15}'

(on CPU also ``VLLM_CPU_KVCACHE_SPACE=1 ... --gpu-memory-utilization 0.2``; with a
GPU build, ``vllm serve MODEL --speculative-config ...`` works too), then::

    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1

Speculative decoding changes no API: requests look exactly as without it.
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
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_num_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        print(f"{name}: {m.group(1) if m else 'n/a (no speculation on this server?)'}")


if __name__ == "__main__":
    main()
