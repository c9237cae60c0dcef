"""What model packages register with generation: drafters and fused forwards.

- Drafters: a builder per speculative mode says which drafter serves a ``generate(assistant_model=...,
  spec_mode=...)`` call; the loop only sees the :class:`Drafter` base. A builder's ``matches(target,
  assistant)`` says whether it recognises the pair (assistant may be None for models that draft with their
  own layers, such as Step 3.5 MTP).
- Fused forwards (:func:`register_fused_forwards`, see ``generation/fusion.py``): the module classes whose
  forwards ``enable`` swaps for fused kernels.
- Expert gates (:func:`register_expert_gate`, see ``generation/experts.py``): what an experts class's own gate
  computes, so that its experts run through the fused MoE kernels.
- Call checks (:func:`register_call_check`): what in a ``generate`` call of a model the paged loop cannot run as
  the model would (e.g. a mask that lets image tokens attend both ways, rotary positions computed from an
  image's grid), so that the call goes to transformers' own loop (or is refused with a drafter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hf_specdec.config import SpecDecodingConfig
from hf_specdec.generation.drafter import Drafter
from hf_specdec.generation.experts import register_expert_gate
from hf_specdec.generation.fusion import FusedForward, register_fused_forwards, register_model_links
from hf_specdec.generation.quantization import check_drafter_weights
from hf_specdec.runtime.distributed import check_replicated
from hf_specdec.runtime.placement import input_device

__all__ = ["DrafterBuilder", "FusedForward", "build_drafter", "call_unsupported", "register_call_check",
           "register_drafter", "register_expert_gate", "register_fused_forwards", "register_model_links"]


@dataclass(frozen=True)
class DrafterBuilder:
    spec_mode: str
    matches: Callable  # (target, assistant) -> bool
    build: Callable  # (target, assistant, num_speculative_tokens | None) -> Drafter
    describe: str  # what this builder expects, for error messages
    # the most drafts a num_speculative_tokens="auto" round may have (None: the drafter's default k)
    auto_k_max: int | None = None
    # (assistant) -> what is wrong, naming the fix, where the assistant is this mode's drafter loaded as something
    # else (e.g. by transformers' Auto class as its base model type), else None
    misloaded: Callable | None = None


_BUILDERS: list[DrafterBuilder] = []


_CALL_CHECKS: list[Callable] = []


def register_call_check(check: Callable) -> None:
    """``check(model, kwargs)`` -> what in this ``generate`` call of ``model`` (its model inputs ``kwargs``) the paged
    loop cannot run as the model would, or None (idempotent)."""
    if check not in _CALL_CHECKS:
        _CALL_CHECKS.append(check)


def call_unsupported(model, kwargs: dict) -> str | None:
    """The first registered call check's reason that this call needs transformers' own loop, or None."""
    return next((reason for check in _CALL_CHECKS if (reason := check(model, kwargs))), None)


def register_drafter(builder: DrafterBuilder) -> None:
    if builder not in _BUILDERS:
        _BUILDERS.append(builder)


def serves(target, assistant, spec_mode: str) -> bool:
    """Whether a registered drafter of ``spec_mode`` fits ``target`` with ``assistant`` (None: the target's own
    layers)."""
    return any(b.spec_mode == spec_mode and b.matches(target, assistant) for b in _BUILDERS)


def build_drafter(target, assistant, spec_mode: str | None = None,
                  num_speculative_tokens: int | str | None = None) -> Drafter:
    """The drafter for this call, with ``spec_mode`` inferred from the assistant when omitted (``"auto"`` k: built for
    the builder's ``auto_k_max`` drafts, else its default k, the most a round drafts). A :class:`Drafter` passed as the
    assistant is used as it is."""
    adaptive = SpecDecodingConfig(spec_mode, num_speculative_tokens).adaptive  # validates both
    if isinstance(assistant, Drafter):
        return assistant
    _check_placement(target, assistant)
    candidates = [b for b in _BUILDERS if spec_mode in (None, b.spec_mode)]
    for builder in candidates:
        if builder.matches(target, assistant):
            return builder.build(target, assistant, builder.auto_k_max if adaptive else num_speculative_tokens)
    other = [b for b in _BUILDERS if b not in candidates and b.matches(target, assistant)]
    if other:
        raise ValueError(
            f"spec_mode={spec_mode!r} does not fit this assistant: it is a {other[0].spec_mode!r} drafter "
            f"({other[0].describe}). Pass spec_mode={other[0].spec_mode!r} or leave spec_mode out."
        )
    known = "; ".join(f"{b.spec_mode}: {b.describe}" for b in _BUILDERS) or "none registered"
    what = type(assistant).__name__ if assistant is not None else "no assistant_model"
    for builder in _BUILDERS:
        problem = builder.misloaded(assistant) if builder.misloaded is not None else None
        if problem:
            raise ValueError(f"the assistant_model ({what}) {problem}")
    raise ValueError(
        f"no speculative mode fits target {type(target).__name__} with {what}. Supported: {known}. Pass the drafter "
        "built for this target (and a matching spec_mode), or neither for plain decoding; for transformers' own "
        "assisted decoding with a small causal LM as assistant, call hf_specdec.disable(model) first."
    )


def _check_placement(target, assistant) -> None:
    """An assistant model must have loaded weights in the target's dtype (refused rather than converted: a silent
    copy of a large model can OOM). Its device is the drafter's to choose: each draft runner moves it beside the
    target layers it reads (runtime/placement.py). It runs replicated on every rank of a tensor-parallel target
    (runtime/distributed.py), so it is never sharded itself."""
    if not isinstance(assistant, torch.nn.Module):
        return
    param = next(assistant.parameters(), None)
    if param is None:
        return
    check_replicated(assistant, "assistant_model")
    check_drafter_weights(assistant)  # drafters stay in the dtype they were loaded in: quantized ones are refused
    device, dtype = input_device(target), target.dtype
    if param.device.type == "meta":
        raise ValueError(f"assistant_model is on meta but the target on {device}; move it first: "
                         f"assistant_model.to({str(device)!r}) works once its weights are loaded (load it with "
                         f"from_pretrained, without device_map='meta').")
    if param.dtype != dtype:
        raise ValueError(f"assistant_model is in {param.dtype} but the target in {dtype}; load both in one dtype "
                         f"(from_pretrained(..., dtype={dtype})) or call assistant_model.to({dtype}).")
