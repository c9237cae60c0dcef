"""The ``"hf_specdec"`` experts function, registered with transformers' ``ExpertsInterface``.

transformers runs the experts of its MoE blocks (Gemma 4's ``Gemma4TextExperts``, and every experts module
decorated with ``use_experts_implementation``) through the implementation the model's config names: the
module calls ``fn(self, hidden_states, top_k_index, top_k_weights)``. ``enable`` registers this function and
selects it for the model (:func:`select_experts`; ``disable`` restores the previous one). On CUDA it runs
:func:`fused_moe`, which reads only the experts this forward's tokens selected, with no host sync (so
decode and verify forwards keep their CUDA graphs). Biases take the kernels' bias terms. A class's own gate (its
``_apply_gate``) runs through the kernels where its model package registered what it computes
(:func:`register_expert_gate`: gpt-oss's interleaved, clamped SwiGLU). On CPU, under autograd, and for experts it does
not cover (an activation other than tanh-GELU or SiLU, an unregistered gate, a norm after each expert, weights that
are not plain parameters) it runs the implementation the model had before ``enable``: the same arithmetic as without
hf_specdec.

Every supported transformers version (5.17 and later) has the interface, so no instance-level patching is
needed.
"""

from __future__ import annotations

import torch
from typing import Callable

from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, _default_apply_gate

from hf_specdec.kernels import use_triton
from hf_specdec.kernels._dispatch import needs_grad
from hf_specdec.kernels.fused_moe import activation_name, fused_moe

EXPERTS_NAME = "hf_specdec"
_FALLBACK = "_hf_specdec_experts_fallback"  # per experts module: the implementation it had before enable
# False: every experts module runs the implementation it had before enable (to compare the two in one process)
FUSED = True
# a class's own ``_apply_gate`` -> (experts -> the kernels' terms: activation, limit, alpha, and whether the gate and
# up columns of the stacked projection interleave)
_GATES: dict[Callable, Callable[[torch.nn.Module], dict]] = {}


def register_expert_gate(apply_gate: Callable, terms: Callable[[torch.nn.Module], dict]) -> None:
    """Run experts whose class's ``_apply_gate`` is ``apply_gate`` through the kernels: ``terms(experts)`` gives
    ``fused_moe``'s ``activation``, ``limit`` and ``alpha``, and ``interleaved`` (gate column c at row 2c of the stacked
    projection, up at 2c + 1) (idempotent)."""
    _GATES[apply_gate] = terms


def hf_specdec_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states [tokens, hidden], top_k_index / top_k_weights [tokens, top_k] -> [tokens, hidden]."""
    weights = fused_weights(self) if FUSED else None
    if weights is None or not use_triton(hidden_states) or needs_grad(hidden_states):
        return _fallback(self)(self, hidden_states, top_k_index, top_k_weights)
    w_gate, w_up, w_down, terms = weights
    return fused_moe(hidden_states, w_gate, w_up, w_down, top_k_index, top_k_weights, **terms)


def fused_weights(experts: torch.nn.Module):
    """(w_gate, w_up [E, I, H], w_down [E, H, I], terms) as views of the module's parameters, ``terms`` the rest of
    :func:`fused_moe`'s arguments (activation, limit, alpha, biases), or None when :func:`fused_moe` does not compute
    what this module computes."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    apply_gate = getattr(type(experts), "_apply_gate", _default_apply_gate)
    if apply_gate is _default_apply_gate:
        activation = activation_name(getattr(experts, "act_fn", None))
        terms = None if activation is None else dict(activation=activation, interleaved=False)
    else:  # a class's own gate: what its model package registered it computes, else not the kernels'
        terms = _GATES[apply_gate](experts) if apply_gate in _GATES else None
    has_bias = getattr(experts, "has_bias", True)
    biases = (getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None))
    # a norm after each expert, or weights that are not plain parameters, compute something else
    if (terms is None or not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor)
            or getattr(experts, "has_post_expert_norm", False) or not getattr(experts, "has_gate", False)
            or type(gate_up) is not torch.nn.Parameter or gate_up.dim() != 3 or down.dim() != 3
            or (has_bias and not all(type(b) is torch.nn.Parameter and b.dim() == 2 and b.dtype == gate_up.dtype
                                     for b in biases))):
        return None
    if getattr(experts, "is_transposed", False):  # stored [E, H, 2I] and [E, I, H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    terms = dict(terms)
    inter = gate_up.shape[1] // 2
    gate, up = ((slice(0, None, 2), slice(1, None, 2)) if terms.pop("interleaved")
                else (slice(0, inter), slice(inter, None)))
    if has_bias:
        terms["biases"] = (biases[0][:, gate], biases[0][:, up], biases[1])
    return gate_up[:, gate], gate_up[:, up], down, terms


def _fallback(experts):
    original = type(experts).forward.__wrapped__  # the class's own forward, under the interface's dispatch
    return ALL_EXPERTS_FUNCTIONS.get_interface(getattr(experts, _FALLBACK, "eager"), original)


def register() -> None:
    """Register the experts function under ``"hf_specdec"`` (idempotent)."""
    ExpertsInterface.register(EXPERTS_NAME, hf_specdec_experts_forward)


def _uses_interface(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an experts module that dispatches through transformers' experts interface."""
    return (getattr(type(module).forward, "__wrapped__", None) is not None and hasattr(module, "is_concatenated")
            and hasattr(getattr(module, "config", None), "_experts_implementation"))


def select_experts(model) -> dict | None:
    """Run ``model``'s interface experts through :func:`hf_specdec_experts_forward`; returns the implementation
    to restore (:func:`restore_experts`), or None when the model has no such experts."""
    modules = [m for m in model.modules() if _uses_interface(m)]
    if not modules or not hasattr(model, "set_experts_implementation"):
        return None
    register()
    previous = model.get_experts_implementation()
    for module in modules:
        setattr(module, _FALLBACK, module.config._experts_implementation)
    model.set_experts_implementation(EXPERTS_NAME)
    return previous


def restore_experts(model, previous: dict | None) -> None:
    """Undo :func:`select_experts`."""
    if previous is None:
        return
    model.set_experts_implementation(previous)
    for module in model.modules():
        if _FALLBACK in vars(module):
            delattr(module, _FALLBACK)
