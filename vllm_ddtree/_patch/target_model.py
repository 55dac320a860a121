"""The target model of a DDTree engine, set up by its speculator at load time (vLLM 0.34).

See the ``target_model`` entry of the ledger in ``_patch/__init__.py``.  Nothing here is
applied at registration: :meth:`vllm_ddtree.gpu.speculator.DDTreeSpeculator.load_model`
calls both functions for its own engine's objects, after the weights load and before
vLLM builds the model state and the attention metadata builders from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

# the target model's attribute that carries its engine's DDTree state to the model state
BINDING_ATTR = "ddtree_binding"


def use_tree_attention(layer: Any, backend_cls: type, impl_cls: type,
                       step_rows: Any) -> None:
    """Switch the attention layer ``layer`` (vLLM's ``Attention``) from vLLM's
    FlashAttention to ``backend_cls`` / ``impl_cls`` (its subclasses) over ``step_rows``
    (the engine's :class:`~vllm_ddtree.gpu.step_rows.StepRows`):
    per instance, its backend and its impl's class (vLLM builds the metadata builder
    from ``layer.get_attn_backend()`` later).  Layers on another backend are left as
    they are (the caller refuses them)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

    if layer.attn_backend is FlashAttentionBackend and type(layer.impl) is FlashAttentionImpl:
        layer.attn_backend = backend_cls
        layer.impl.__class__ = impl_cls
        layer.impl.step_rows = step_rows


def bind_model_state(target_model: nn.Module, state_cls: type, binding: Any) -> None:
    """Make vLLM build ``target_model``'s ModelState as ``state_cls`` over ``binding``
    (vLLM's ``init_model_state`` calls the model's ``get_model_state_cls`` and passes the
    model to the state's constructor, which reads :func:`bound_state`)."""
    setattr(target_model, BINDING_ATTR, binding)
    target_model.get_model_state_cls = lambda: state_cls


def bound_state(target_model: nn.Module) -> Any:
    """The binding :func:`bind_model_state` gave ``target_model``."""
    binding = getattr(target_model, BINDING_ATTR, None)
    if binding is None:
        raise RuntimeError(
            f"vllm-ddtree: vLLM built a DDTree model state for {type(target_model).__name__} "
            "that carries no DDTree state; DDTreeSpeculator.load_model binds it before "
            "vLLM builds the model state.")
    return binding
