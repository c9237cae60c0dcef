"""Step 3.5 building blocks: zero-centred RMSNorm, per-layer RoPE, clamped SwiGLU, routed MoE, gated attention.

Numerics follow StepFun's reference code and vLLM's ``step3p5`` model (read for facts only):
- RMSNorm computes in fp32 and scales by ``1 + weight`` (weights are stored zero-centred).
- SwiGLU with a limit ``c``: ``silu(gate).clamp(max=c) * up.clamp(-c, c)``; ``c = 0`` means no clamp.
- Router: fp32 logits, sigmoid scores; ``router_bias`` is added for the top-k *selection* only, the
  weights are the selected sigmoid scores, renormalised (``norm_expert_weight``) and multiplied by
  ``moe_router_scaling_factor``.
- Attention: per-head ``q_norm``/``k_norm`` before RoPE, RoPE on the first ``partial_rotary_factor``
  of each head (neox halves), ``scaling = head_dim**-0.5``, head-wise gate
  ``out[h] *= sigmoid(g_proj(x))[h]`` before ``o_proj``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import eager_attention_forward, rotate_half

from hf_specdec.kernels.fused_moe import fused_moe, gated_activation_reference, sigmoid_bias_topk_route
from hf_specdec.kernels.gelu_mul import head_gate_mul_reference
from hf_specdec.kernels.skinny_gemm import fp32_linear
from hf_specdec.kernels.stacked_linear import stacked_projections
from hf_specdec.runtime.placement import loaded_weights
from hf_specdec.models.step3p5.configuration import Step3p5Config


class Step3p5RMSNorm(GemmaRMSNorm):
    """``x / rms(x) * (1 + weight)`` computed in fp32, cast back to the input dtype (Gemma's norm; eps 1e-5)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__(dim, eps)


# ---------------------------------------------------------------- RoPE


def default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    """Standard RoPE inverse frequencies, [rotary_dim // 2]."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths / factor, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def layer_inv_freq(config: Step3p5Config, i: int) -> torch.Tensor:
    """Inverse frequencies of layer `i` (main or MTP), [rotary_dim // 2]."""
    rotary_dim = int(config.layer_head_dim(i) * config.layer_partial_rotary_factor(i))
    inv_freq = default_inv_freq(config.layer_rope_theta(i), rotary_dim)
    scaling = config.layer_rope_scaling_params(i)
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type != "llama3":
        raise ValueError(f"Step 3.5 rope_scaling type {rope_type!r} is not supported (only 'llama3')")
    return llama3_inv_freq(inv_freq, scaling)


def _rope_key(config: Step3p5Config, i: int) -> str:
    scaling = config.layer_rope_scaling_params(i)
    return f"{config.layer_head_dim(i)}|{config.layer_rope_theta(i)}|{config.layer_partial_rotary_factor(i)}|{scaling}"


class Step3p5RotaryEmbedding(nn.Module):
    """RoPE tables for every distinct (head_dim, theta, partial factor, scaling) among main + MTP layers.

    ``forward`` returns ``(cos, sin)`` [batch, seq, rotary_dim] for one layer; layers sharing a kind
    share the table, and the model computes each kind once per forward. The buffers are
    non-persistent; ``Step3p5PreTrainedModel._init_weights`` refills them after meta-device loading.
    """

    def __init__(self, config: Step3p5Config):
        super().__init__()
        self.config = config
        keys = [_rope_key(config, i) for i in range(config.num_total_layers)]
        kinds = list(dict.fromkeys(keys))
        self.layer_kind = [kinds.index(k) for k in keys]
        self.kind_layer = [keys.index(k) for k in kinds]  # one representative layer per kind
        for kind, layer in enumerate(self.kind_layer):
            self.register_buffer(f"inv_freq_{kind}", layer_inv_freq(config, layer), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = getattr(self, f"inv_freq_{kind}").float()  # [rotary_dim // 2]
        freqs = position_ids[..., None].float() * inv_freq.to(x.device)  # [batch, seq, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def apply_partial_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE on the first ``cos.shape[-1]`` dims of each head; q/k [batch, heads, seq, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    d = cos.shape[-1]

    def rotate(x):
        x_rot, x_pass = x[..., :d], x[..., d:]
        return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)

    return rotate(q), rotate(k)


# ---------------------------------------------------------------- MLP / MoE


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(gate) * up``; with a limit, silu(gate) is clamped above and up on both sides."""
    return gated_activation_reference(gate, up, "silu", limit)


class Step3p5MLP(nn.Module):
    """Dense SwiGLU MLP (``mlp``) and the MoE layers' shared expert (``share_expert``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        gate, up = stacked_projections(x, self.gate_proj, self.up_proj)  # one GEMM once enable stacked them
        return self.down_proj(clamped_swiglu(gate, up, self.limit))


class Step3p5ExpertLinear(nn.Module):
    """Packed expert weights ``weight [num_experts, out, in]`` (checkpoint key ``moe.{gate,up,down}_proj.weight``)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        return F.linear(x, self.weight[expert])


class Step3p5MoE(nn.Module):
    """Routed experts of an MoE layer (checkpoint prefix ``moe.``); the shared expert lives beside it."""

    def __init__(self, config: Step3p5Config, limit: float | None):
        super().__init__()
        h, inter, n = config.hidden_size, config.moe_intermediate_size, config.moe_num_experts
        self.top_k = config.moe_top_k
        self.renormalize = config.norm_expert_weight
        self.scaling_factor = float(config.moe_router_scaling_factor)
        self.limit = limit
        self.gate = nn.Linear(h, n, bias=False)
        self.router_bias = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)
        self.gate_proj = Step3p5ExpertLinear(n, h, inter)
        self.up_proj = Step3p5ExpertLinear(n, h, inter)
        self.down_proj = Step3p5ExpertLinear(n, inter, h)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (weights [tokens, top_k], experts [tokens, top_k]); fp32 router (on the GPU its
        logits are the fp32 sums of the bf16 products, the weight never cast: :func:`fp32_linear`)."""
        logits = fp32_linear(x, self.gate.weight)
        return sigmoid_bias_topk_route(logits, self.router_bias, self.top_k, self.renormalize, self.scaling_factor)

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:  # [tokens, hidden] -> [tokens, hidden]
        return self.down_proj(clamped_swiglu(self.gate_proj(x, e), self.up_proj(x, e), self.limit), e)

    def forward(self, hidden_states: torch.Tensor, addends: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """hidden_states [..., hidden] -> like it. Only the experts the tokens selected run: on CUDA the fused
        kernel reads each selected expert once per forward with no host sync (CUDA-graph capturable); elsewhere,
        and under autograd, its torch reference runs one pass per selected expert. ``addends`` (up to two tensors
        like hidden_states, e.g. the shared expert's output and the residual): added to the experts' sum in turn,
        in the sum's launch where the kernels run."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        with loaded_weights(self.gate, self.gate_proj, self.up_proj, self.down_proj):  # read without their forwards
            weights, experts = self.route(x)
            out = fused_moe(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, experts, weights,
                            activation="silu", limit=self.limit, addends=tuple(a.reshape(x.shape) for a in addends))
        return out.reshape(hidden_states.shape)


# ---------------------------------------------------------------- attention


class Step3p5Attention(nn.Module):
    """GQA attention with per-layer head count, q/k norms, partial RoPE and a head-wise sigmoid gate.

    Goes through ``ALL_ATTENTION_FUNCTIONS`` and ``past_key_values.update(k, v, layer_idx)`` exactly
    like HF's Llama attention, so a registered attention function receives every extra forward kwarg.
    MTP blocks use their global index (``num_hidden_layers + k``) as ``layer_idx``.
    """

    def __init__(self, config: Step3p5Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.layer_num_heads(layer_idx)
        self.num_key_value_heads = config.layer_num_kv_heads(layer_idx)
        self.head_dim = config.layer_head_dim(layer_idx)
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.layer_sliding_window(layer_idx)
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = Step3p5RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Step3p5RMSNorm(self.head_dim, config.rms_norm_eps)
        self.g_proj = nn.Linear(h, self.num_heads, bias=False) if config.use_head_wise_attn_gate else None

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
                attention_mask: torch.Tensor | None, past_key_values=None, **kwargs):
        """hidden_states [batch, seq, hidden] -> (out [batch, seq, hidden], attention weights or None);
        position_embeddings None = no RoPE."""
        query, key, value, gate = self.projections(hidden_states)
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_norm(query.reshape(hidden_shape)).transpose(1, 2)
        key = self.k_norm(key.reshape(hidden_shape)).transpose(1, 2)
        if position_embeddings is not None:
            query, key = apply_partial_rotary(query, key, *position_embeddings)
        return self.attend(query, key, value.reshape(hidden_shape).transpose(1, 2), gate, attention_mask,
                           past_key_values, **kwargs)

    def projections(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v, head-wise gate logits or None) [batch, seq, width]: one GEMM once ``enable`` stacked them."""
        projections = (self.q_proj, self.k_proj, self.v_proj) + ((self.g_proj,) if self.g_proj is not None else ())
        query, key, value, *gate = stacked_projections(hidden_states, *projections)
        return query, key, value, gate[0] if gate else None

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, gate: torch.Tensor | None,
               attention_mask: torch.Tensor | None, past_key_values=None, head_gate=head_gate_mul_reference,
               **kwargs):
        """Attention over the normalised, rotated heads [batch, heads, seq, head_dim] (through the cache), the
        head-wise gate (``head_gate(out, gate)``: ``out * sigmoid(gate)`` per head), o_proj -> (out [batch, seq,
        hidden], attention weights or None)."""
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
        )  # out [batch, seq, heads, head_dim]
        if gate is not None:
            out = head_gate(out, gate)
        return self.o_proj(out.reshape(*out.shape[:2], -1)), weights
