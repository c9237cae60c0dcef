"""Step 3.5's fused forwards, registered with ``enable`` (``generation/fusion.py``).

A Step 3.5 decode step otherwise runs each of its norms (two per layer, the per-head q and k norms, an MTP
layer's head norm) as ~8 eager kernels, its partial rotary as ~10 more per layer, and its same-input projections as
separate GEMMs. Where the kernels run, its zero-centred norms take one launch each (:func:`rms_norm` with
``weight_offset=1``: ``x / rms(x) * (1 + weight)`` in fp32, GemmaRMSNorm's arithmetic); an attention's q and k
norms and its partial rotary take one launch together (:func:`qkv_norm_rope`), an MLP's clamped SwiGLU one
(:func:`silu_mul`); and ``enable`` stacks an attention's q/k/v and head-wise gate projections, and an MLP's (dense
or shared expert) gate and up projections, into one storage each, so that they run as one GEMM per group
(:func:`stacked_projections`). Each fused forward runs the module's own forward on CPU and whenever autograd
tracks the input (the kernels have no backward).
"""

from __future__ import annotations

import torch

from hf_specdec.generation.registry import FusedForward, register_fused_forwards
from hf_specdec.kernels import use_triton
from hf_specdec.kernels._dispatch import needs_grad
from hf_specdec.kernels.gelu_mul import head_gate_mul, silu_mul
from hf_specdec.kernels.norm_rope import qkv_norm_rope
from hf_specdec.kernels.rms_norm import add_rms_norm, rms_norm
from hf_specdec.kernels.stacked_linear import stacked_projections
from hf_specdec.models.step3p5.layers import Step3p5Attention, Step3p5MLP, Step3p5RMSNorm
from hf_specdec.models.step3p5.modeling import Step3p5DecoderLayer, Step3p5MTPLayer
from hf_specdec.runtime.distributed import is_sharded


def _step3p5_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not use_triton(hidden_states) or needs_grad(hidden_states):
        return type(self).forward(self, hidden_states)  # the module's own ops
    return rms_norm(hidden_states, self.weight, self.eps, weight_offset=1.0)


def _step3p5_attention_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask,
                               past_key_values=None, **kwargs):
    """``Step3p5Attention.forward`` with its q/k norms and partial rotary in one launch (the values are not
    normalised: ``qkv_norm_rope`` with v None). The CPU, autograd and a call without rotary run the original."""
    if not use_triton(hidden_states) or needs_grad(hidden_states) or position_embeddings is None:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                                  **kwargs)
    query, key, value, gate = self.projections(hidden_states)
    hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    norms = (self.q_norm, self.k_norm)
    query, key, _ = qkv_norm_rope(query.view(hidden_shape), key.view(hidden_shape), None,
                                  (norms[0].weight, norms[1].weight, None), (norms[0].eps, norms[1].eps, 0.0),
                                  *position_embeddings, weight_offset=1.0)
    return self.attend(query.transpose(1, 2), key.transpose(1, 2), value.reshape(hidden_shape).transpose(1, 2),
                       gate, attention_mask, past_key_values, head_gate=head_gate_mul, **kwargs)


def _fusible_attention(module) -> bool:
    """The norms the fused forward reads: zero-centred, one weight per head dim."""
    return all(type(n) is Step3p5RMSNorm and n.weight.shape == (module.head_dim,)
               for n in (module.q_norm, module.k_norm))


def _step3p5_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``Step3p5MLP.forward`` (a dense MLP or a shared expert) with its clamped SwiGLU in one launch
    (:func:`silu_mul`) after one GEMM for gate and up. The CPU and autograd run the original."""
    if not use_triton(x) or needs_grad(x):
        return type(self).forward(self, x)
    return self.down_proj(silu_mul(*stacked_projections(x, self.gate_proj, self.up_proj), self.limit))


def _step3p5_decoder_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                             past_key_values=None, **kwargs) -> torch.Tensor:
    """``Step3p5DecoderLayer.forward`` with the residual add after attention and the norm after it in one launch
    (:func:`add_rms_norm`), and in an MoE layer the shared expert's output and the residual added in the experts'
    sum launch (``Step3p5MoE.forward(..., addends=)``; not under tensor parallelism, whose all-reduce of the
    experts' output would sum them once per rank). The CPU and autograd run the original."""
    if not use_triton(hidden_states) or needs_grad(hidden_states):
        return Step3p5DecoderLayer.forward(self, hidden_states, position_embeddings, attention_mask,
                                           past_key_values=past_key_values, **kwargs)
    attn_out, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                                 past_key_values=past_key_values, **kwargs)
    norm = self.post_attention_layernorm
    hidden_states, x = add_rms_norm(attn_out, hidden_states, norm.weight, norm.eps, weight_offset=1.0)
    if hasattr(self, "moe"):
        if is_sharded(self.moe):  # its tensor-parallel style sums its output over the ranks: nothing may join it
            return hidden_states + (self.moe(x) + self.share_expert(x))
        return self.moe(x, addends=(self.share_expert(x), hidden_states))
    return hidden_states + self.mlp(x)


def _step3p5_mtp_layer_forward(self, inputs_embeds: torch.Tensor, previous_hidden_states: torch.Tensor,
                               position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
    """``Step3p5MTPLayer.forward`` whose block runs the fused decoder forward above."""
    if not use_triton(inputs_embeds) or needs_grad(inputs_embeds):
        return Step3p5MTPLayer.forward(self, inputs_embeds, previous_hidden_states, position_embeddings,
                                       attention_mask, past_key_values=past_key_values, **kwargs)
    fused = torch.cat([self.enorm(inputs_embeds), self.hnorm(previous_hidden_states)], dim=-1)
    return _step3p5_decoder_forward(self, self.eh_proj(fused), position_embeddings, attention_mask,
                                    past_key_values=past_key_values, **kwargs)


def _fusible_layer(module) -> bool:
    """The post-attention norm the fused forward reads: zero-centred, over the hidden size."""
    norm = module.post_attention_layernorm
    return type(norm) is Step3p5RMSNorm and _fusible_norm(norm)


def _fusible_norm(module) -> bool:
    return isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 1


def register() -> None:
    """Register Step 3.5's fused forwards with ``enable`` (idempotent)."""
    register_fused_forwards(
        FusedForward(Step3p5RMSNorm, _step3p5_rms_norm_forward, _fusible_norm),
        FusedForward(Step3p5Attention, _step3p5_attention_forward, _fusible_attention,
                     stacked=(("q_proj", "k_proj", "v_proj", "g_proj"),)),
        FusedForward(Step3p5MLP, _step3p5_mlp_forward, stacked=(("gate_proj", "up_proj"),)),
        FusedForward(Step3p5DecoderLayer, _step3p5_decoder_forward, _fusible_layer),
        FusedForward(Step3p5MTPLayer, _step3p5_mtp_layer_forward, _fusible_layer),
    )
