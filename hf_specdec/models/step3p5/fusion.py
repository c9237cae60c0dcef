"""Step 3.5's fused forwards, registered with ``enable`` (``generation/fusion.py``).

A Step 3.5 decode step otherwise runs each of its norms (two per layer, the per-head q and k norms, an MTP
layer's head norm) as ~8 eager kernels, and its same-input projections as separate GEMMs. Where the kernels run,
its zero-centred norms take one launch each (:func:`rms_norm` with ``weight_offset=1``: ``x / rms(x) * (1 +
weight)`` in fp32, GemmaRMSNorm's arithmetic), and ``enable`` stacks an attention's q/k/v and head-wise gate
projections, and an MLP's (dense or shared expert) gate and up projections, into one storage each, so that their
forwards (which go through :func:`stacked_projections`) run one GEMM per group. Each fused forward runs the
module's own forward on CPU and whenever autograd tracks the input (the kernels have no backward).
"""

from __future__ import annotations

import torch

from hf_specdec.generation.registry import FusedForward, register_fused_forwards
from hf_specdec.kernels import use_triton
from hf_specdec.kernels._dispatch import needs_grad
from hf_specdec.kernels.rms_norm import rms_norm
from hf_specdec.models.step3p5.layers import Step3p5Attention, Step3p5MLP, Step3p5RMSNorm


def _step3p5_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not use_triton(hidden_states) or needs_grad(hidden_states):
        return type(self).forward(self, hidden_states)  # the module's own ops
    return rms_norm(hidden_states, self.weight, self.eps, weight_offset=1.0)


def _fusible_norm(module) -> bool:
    return isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 1


def register() -> None:
    """Register Step 3.5's fused forwards with ``enable`` (idempotent). The attention and MLP keep their own
    forwards (they run their projections through :func:`stacked_projections`); their entries name the groups that
    ``enable`` stacks where the kernels run."""
    register_fused_forwards(
        FusedForward(Step3p5RMSNorm, _step3p5_rms_norm_forward, _fusible_norm),
        FusedForward(Step3p5Attention, Step3p5Attention.forward, stacked=(("q_proj", "k_proj", "v_proj", "g_proj"),)),
        FusedForward(Step3p5MLP, Step3p5MLP.forward, stacked=(("gate_proj", "up_proj"),)),
    )
