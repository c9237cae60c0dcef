"""Fused replacements for small modules of an enabled model (instance-scoped, undone by ``disable``).

A decode step of a big model is bound by weight bytes, but each of its ~10 norms per layer runs as ~8
tiny kernels in eager torch, and those launches cost ~20% of a step even inside a CUDA graph. ``enable``
swaps the ``forward`` of such modules, on that model's instances only, for one fused kernel with the
same arithmetic (on CPU the kernel's torch reference runs: the same ops as the original).
"""

from __future__ import annotations

import types

import torch

from hf_specdec.kernels import use_triton
from hf_specdec.kernels.rms_norm import rms_norm


def _gemma_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not use_triton(hidden_states):
        return type(self).forward(self, hidden_states)  # the module's own ops: the same arithmetic, no wrapper
    return rms_norm(hidden_states, self.weight if self.with_scale else None, self.eps)


# class name -> fused forward (names, so that no model package has to be imported here)
FUSED_FORWARDS = {"Gemma4RMSNorm": _gemma_rms_norm_forward}


def fuse_modules(model: torch.nn.Module) -> int:
    """Give every fusible submodule of ``model`` its fused forward; returns how many were swapped."""
    count = 0
    for module in model.modules():
        fused = FUSED_FORWARDS.get(type(module).__name__)
        if fused is not None and "forward" not in vars(module):
            module.forward = types.MethodType(fused, module)
            count += 1
    return count


def unfuse_modules(model: torch.nn.Module) -> None:
    """Undo :func:`fuse_modules`."""
    for module in model.modules():
        forward = vars(module).get("forward")
        if forward is not None and getattr(forward, "__func__", None) in FUSED_FORWARDS.values():
            del module.forward
