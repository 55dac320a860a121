"""Tree attention on vLLM's CPU backend (``CPU_ATTN``).

The CPU kernel has no mask and returns no log-sum-exp, so after vLLM's own kernel has
run (causally) over the whole batch, the verify rows of tree requests are recomputed
in torch: the paged prefix (unpacked from the ISA-specific layout) plus the request's
fresh verify rows, masked to ancestors-or-self.  The same layer also keeps the verify
rows' K/V for the compaction that follows the walk.  Rows of other requests and every
drafter layer are left exactly as vLLM computed them.

Installed per layer: after the target model loads, the runner switches each target
attention layer's ``impl`` instance to :class:`DDTreeCPUAttentionImpl` (a subclass that
adds state to nothing but the forward), so no process-wide backend registry or cache is
touched and drafter layers keep vLLM's class.
"""

from __future__ import annotations

import math

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from vllm_ddtree.cpu import active


def unpack_blocks(buf: torch.Tensor, isa: str, is_key: bool) -> torch.Tensor:
    """``[n, kvh, bs, hd]`` packed blocks -> ``[n * bs, kvh, hd]`` rows in slot order."""
    n, kvh, bs, hd = buf.shape
    if isa == "amx":
        if is_key:
            x = buf.reshape(n, kvh, bs // 16, hd // 2, 16, 2).permute(0, 1, 2, 4, 3, 5)
        else:
            x = buf.reshape(n, kvh, hd // 16, bs // 2, 16, 2).permute(0, 1, 3, 5, 2, 4)
        x = x.reshape(n, kvh, bs, hd)
    elif is_key:  # vec / vec16: K stored transposed per block
        x = buf.reshape(n, kvh, hd, bs).transpose(-1, -2)
    else:
        x = buf.reshape(n, kvh, bs, hd)
    return x.permute(0, 2, 1, 3).reshape(n * bs, kvh, hd)


class DDTreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                              output_scale, output_block_scale)
        step = active.step
        if step is None or attn_metadata is None or layer.layer_name not in step.target_layers:
            return out
        self._tree_rows(layer, query, key, value, kv_cache, attn_metadata, output, step)
        return out

    def _tree_rows(self, layer, query, key, value, kv_cache, md, output, step):
        nb, kvh, bs, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(nb, kvh, 2 * bs, -1).chunk(2, dim=2)
        nh, hd = self.num_heads, self.head_size
        out = output.view(output.shape[0], nh, hd)
        if not step.requests:
            return
        for req in step.requests:
            if req.is_chain:  # vLLM's causal kernel already computed these rows
                continue
            rows = slice(req.start, req.start + req.num_nodes + 1)
            p = req.prefix_len
            blocks = md.block_table[req.index, :math.ceil(p / bs)].long()
            kp = unpack_blocks(key_cache[blocks], layer.isa, True)[:p]
            vp = unpack_blocks(value_cache[blocks], layer.isa, False)[:p]
            k = torch.cat([kp.to(key.dtype), key[rows]], 0).float().transpose(0, 1)
            v = torch.cat([vp.to(value.dtype), value[rows]], 0).float().transpose(0, 1)
            q = query[rows].float().transpose(0, 1)  # [nh, n, hd]; k, v: [kvh, L, hd]
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=req.verify_mask, scale=self.scale, enable_gqa=nh != kvh)
            out[rows] = o.transpose(0, 1).to(out.dtype)
        rows_all = step.rows
        step.kv_rows[layer.layer_name] = (layer, self, kv_cache, key[rows_all].clone(),
                                          value[rows_all].clone(),
                                          md.slot_mapping[rows_all].clone())


SUPPORTED_ISAS = ("vec", "vec16", "amx")  # KV layouts whose unpacking is verified


def check_supported(name: str, layer) -> None:
    """Refuse, at load time, layers whose tree rows this path cannot compute exactly."""
    impl = layer.impl
    problems = []
    if type(impl) not in (CPUAttentionBackendImpl, DDTreeCPUAttentionImpl):
        problems.append(f"backend {type(impl).__qualname__} (only vLLM's CPU_ATTN)")
    if impl.alibi_slopes is not None:
        problems.append("ALiBi")
    if impl.sliding_window not in (None, -1):
        problems.append("sliding window")
    if impl.sinks is not None:
        problems.append("attention sinks")
    if impl.logits_soft_cap:
        problems.append("logit soft-capping")
    if impl.is_fp8_kv_cache:
        problems.append("fp8 KV cache")
    if getattr(impl, "kv_sharing_target_layer_name", None):
        problems.append("KV shared with another layer")
    isa = getattr(layer, "isa", None)
    if isa not in SUPPORTED_ISAS:
        problems.append(f"CPU attention ISA {isa!r} (verified: {', '.join(SUPPORTED_ISAS)})")
    if problems:
        raise NotImplementedError(
            f"vllm-ddtree: target attention layer {name} is not supported by the CPU tree "
            f"path: {'; '.join(problems)}. Use method 'dflash' for this model.")


def install(layers) -> None:
    """Switch the given target attention layers to the tree-aware implementation."""
    for name, layer in layers.items():
        check_supported(name, layer)
        layer.impl.__class__ = DDTreeCPUAttentionImpl
