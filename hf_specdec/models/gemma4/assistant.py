"""Gemma 4 MTP assistant (drafter): Q-only layers over the target's K/V, one token per draft step.

One draft step (transformers' `Gemma4AssistantForCausalLM` + `SinglePositionMultiTokenCandidateGenerator`):

    x      = pre_projection(cat[target_embed(token), h_prev])   # target_embed is the target's *scaled* embedding
    x      = layer_i(x) for each assistant layer                 # attention reads the target's K/V, writes none
    normed = model.norm(x)
    h_next = post_projection(normed)                             # fed back as h_prev of the next step
    logits = centroid head or tied LM head on `normed`

`h_prev` of the first step is the target's last hidden state *after* its final norm (transformers'
`hidden_states[-1]`) at the last accepted position. Every step of a round queries at the same position
`p`: the position of the token being fed, which the target has not processed yet.

The model knows nothing about caches: each layer hands its query to a `TargetKVSource`, which attends over
the K/V of the producer target layer of the same layer type (`producer_layer_for`) restricted to the
accepted context. `DenseTargetKVSource` is the dense reference; a paged cache provides another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextMLP,
    Gemma4TextRotaryEmbedding,
)

from hf_specdec.kernels._dispatch import needs_grad, other_hooks
from hf_specdec.kernels.embed_concat import embed_concat
from hf_specdec.kernels.gelu_mul import gelu_tanh_mul
from hf_specdec.kernels.norm_rope import qkv_norm_rope, qkv_norm_rope_reference
from hf_specdec.kernels.rms_norm import norm_add, rms_norm
from hf_specdec.kernels.stacked_linear import stacked_projections
from hf_specdec.models.loading import check_checkpoint_keys

from .assistant_config import (
    LAYER_TYPES,
    HFSpecGemma4AssistantConfig,
    module_config,
    producer_layer_for,
    target_text_config,
)
from .centroid_head import CentroidHead, DenseLogits, DraftLogits, softcap


class TargetKVSource(Protocol):
    def attend(
        self,
        layer_type: str,
        query: torch.Tensor,  # [batch, 1, num_heads, head_dim], RoPE applied at each row's draft position p
        *,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [batch, 1, num_heads, head_dim]
        """Attend over the K/V of the producer target layer of `layer_type`, accepted context only.

        Full layers (`sliding_window=None`): every accepted position [0, p-1] of the row.
        Sliding layers: the last `sliding_window` accepted positions [p - sliding_window, p - 1].
        Stale K/V of rejected drafts must never be visible. Scores are `scaling * q.k`; GQA maps query
        head h to kv head h // (num_heads // kv_heads).
        """
        ...


def draft_sliding_window(text_config) -> int:
    """How many accepted positions a sliding assistant layer sees.

    transformers' assistant masks with `|q_idx - kv_idx| <= sliding_window` on the flipped kv axis
    (`masking_utils.sliding_window_bidirectional_overlay`), i.e. the last `sliding_window + 1` positions,
    one more than the target's own sliding layers see. We match it.
    """
    return text_config.sliding_window + 1


class DenseTargetKVSource:
    """`TargetKVSource` over dense K/V tensors: the CPU reference and the test oracle.

    `kv[layer_type] = (keys, values)`, each [batch, kv_heads, seq, head_dim], all on the same seq axis;
    `kv_mask` [batch, seq] marks the entries that hold accepted positions (False for left padding and for
    stale drafts). "The last w positions" means the last w entries where `kv_mask` is True.
    """

    def __init__(self, kv: Mapping[str, tuple[torch.Tensor, torch.Tensor]], kv_mask: torch.Tensor | None = None):
        self.kv = dict(kv)
        keys = next(iter(self.kv.values()))[0]
        self.kv_mask = kv_mask.bool() if kv_mask is not None else keys.new_ones(keys.shape[0], keys.shape[2]).bool()

    @classmethod
    def from_cache(cls, cache, target_config, kv_mask: torch.Tensor | None = None) -> DenseTargetKVSource:
        """Read the producer layers' K/V out of a transformers `DynamicCache` of the target (no sliding cropping)."""
        producers = {t: producer_layer_for(target_config, t) for t in LAYER_TYPES}
        kv = {t: (cache.layers[i].keys, cache.layers[i].values) for t, i in producers.items()}
        return cls(kv, kv_mask)

    def attend(self, layer_type, query, *, scaling, sliding_window):
        keys, values = self.kv[layer_type]
        mask = self.kv_mask if sliding_window is None else last_valid(self.kv_mask, sliding_window)
        return dense_attention(query, keys, values, mask, scaling)


def last_valid(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Keep the last `window` True entries of each row of `mask` [batch, seq]."""
    from_end = mask.flip(-1).cumsum(-1).flip(-1)  # number of True entries at or after each index
    return mask & (from_end <= window)


def dense_attention(
    query: torch.Tensor,  # [batch, 1, num_heads, head_dim]
    keys: torch.Tensor,  # [batch, kv_heads, seq, head_dim]
    values: torch.Tensor,  # [batch, kv_heads, seq, head_dim]
    mask: torch.Tensor,  # [batch, seq] bool, True = attend
    scaling: float,
) -> torch.Tensor:  # [batch, 1, num_heads, head_dim]
    batch, _, num_heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    q = query.reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.einsum("bgrd,bgsd->bgrs", q, keys).float() * scaling
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    weights = scores.softmax(-1).to(values.dtype)
    return torch.einsum("bgrs,bgsd->bgrd", weights, values).reshape(batch, 1, num_heads, values.shape[-1])


class AssistantAttention(nn.Module):
    """Q-only attention: `q = rope(q_norm(q_proj(x)))`, K/V come from the target through a `TargetKVSource`."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        layer = config.per_layer_config[layer_idx]
        self.layer_type = config.layer_types[layer_idx]
        self.num_heads, self.head_dim = layer.num_attention_heads, layer.head_dim
        self.sliding_window = draft_sliding_window(config) if self.layer_type == "sliding_attention" else None
        self.scaling = 1.0  # Gemma 4: q_norm/k_norm replace 1/sqrt(head_dim)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [batch, 1, hidden]
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [batch, 1, head_dim]
        kv_source: TargetKVSource,
    ) -> torch.Tensor:  # [batch, 1, hidden]
        batch = hidden_states.shape[0]
        query = self.q_proj(hidden_states).view(batch, 1, self.num_heads, self.head_dim)
        # rope(q_norm(query)): one launch on the GPU; transformers' ops on CPU and under autograd (training)
        norm_rope = qkv_norm_rope_reference if needs_grad(query) else qkv_norm_rope
        query = norm_rope(query, None, None, (self.q_norm.weight, None, None), (self.q_norm.eps, 0.0, 0.0),
                          *position_embeddings)[0]
        out = kv_source.attend(self.layer_type, query, scaling=self.scaling, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(batch, 1, self.num_heads * self.head_dim))


class AssistantDecoderLayer(nn.Module):
    """Gemma 4 sandwich-norm block (as `Gemma4TextDecoderLayer`, without PLE/MoE), scaled by `layer_scalar`."""

    layer_scalar: torch.Tensor

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = AssistantAttention(config, layer_idx)
        self.mlp = Gemma4TextMLP(config, layer_idx)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.gelu_tanh = config.hidden_activation == "gelu_pytorch_tanh"  # the MLP's act_fn: gelu_tanh_mul fuses it

    def forward(self, hidden_states, position_embeddings, kv_source: TargetKVSource) -> torch.Tensor:
        if needs_grad(hidden_states):  # training: the torch ops (the kernels below have no backward)
            attn = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, kv_source)
            hidden_states = hidden_states + self.post_attention_layernorm(attn)
            mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
            hidden_states = hidden_states + self.post_feedforward_layernorm(mlp)
            return hidden_states * self.layer_scalar
        norm = self.input_layernorm
        return self.fused_forward(hidden_states, rms_norm(hidden_states, norm.weight, norm.eps), position_embeddings,
                                  kv_source)[0]

    def fused_forward(self, hidden_states, normed, position_embeddings, kv_source: TargetKVSource,
                      next_norm: Gemma4RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafting: (the block's output, ``next_norm`` of it) from the input and its input norm ``normed``,
        with the norm/residual seams fused (:func:`norm_add`, torch's ops on CPU). The last seam also applies
        the norm that reads the block's output next (the next block's input norm, or the final norm), so no
        norm runs on its own: one launch less per block."""
        attn = self.self_attn(normed, position_embeddings, kv_source)
        post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
        hidden_states, mlp_in = norm_add(attn, hidden_states, post.weight, post.eps, next_weight=pre.weight,
                                         next_eps=pre.eps)
        post = self.post_feedforward_layernorm
        mlp = self.mlp
        mlp_out = (mlp.down_proj(gelu_tanh_mul(*stacked_projections(mlp_in, mlp.gate_proj, mlp.up_proj)))
                   if self.gelu_tanh else mlp(mlp_in))
        return norm_add(mlp_out, hidden_states, post.weight, post.eps, scale=self.layer_scalar,
                        next_weight=None if next_norm is None else next_norm.weight,
                        next_eps=None if next_norm is None else next_norm.eps)


class AssistantBackbone(nn.Module):
    """The `model.` part of the checkpoint. `embed_tokens` is only the tied LM head: inputs use the target's."""

    def rope_tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """(cos, sin) per layer type at ``position_ids`` [batch, 1], in ``x``'s dtype."""
        return {t: self.rotary_emb(x, position_ids, t) for t in {layer.layer_type for layer in self.layers}}

    def __init__(self, text_config):
        super().__init__()
        config = module_config(text_config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(AssistantDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Gemma4TextRotaryEmbedding(config)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [batch, 1, hidden]
        position_ids: torch.Tensor,  # [batch, 1]
        kv_source: TargetKVSource,
        rope: dict | None = None,  # from `rope_tables` (the k steps of a round share the draft position)
    ) -> torch.Tensor:  # [batch, 1, hidden], after the final norm
        if rope is None:
            rope = self.rope_tables(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        if needs_grad(hidden_states) or not self.layers or any(_hooked(layer) for layer in self.layers):
            # training (the torch ops: the kernels have no backward), or layers with hooks (e.g. accelerate's
            # offloading), which must see each layer's call: one call per layer
            for layer in self.layers:
                hidden_states = layer(hidden_states, rope[layer.layer_type], kv_source)
            norm = self.norm
            return norm(hidden_states) if needs_grad(hidden_states) else rms_norm(hidden_states, norm.weight, norm.eps)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        normed = rms_norm(hidden_states, self.layers[0].input_layernorm.weight, self.layers[0].input_layernorm.eps)
        for layer, next_norm in zip(self.layers, norms):
            hidden_states, normed = layer.fused_forward(hidden_states, normed, rope[layer.layer_type], kv_source,
                                                        next_norm)
        return normed


def _hooked(module: nn.Module) -> bool:
    return bool(other_hooks(module, pre=False) or other_hooks(module, pre=True) or getattr(module, "_hf_hook", None))


@dataclass(frozen=True)
class AssistantStepOutput:
    hidden_next: torch.Tensor  # [batch, backbone_hidden]: h_prev of the next draft step
    logits: DraftLogits  # CandidateLogits (centroid head) or DenseLogits (tied LM head)


class Gemma4MTPAssistant(PreTrainedModel):
    """Gemma 4 MTP assistant in the released checkpoint layout (`google/gemma-4-*-it-assistant`).

    `from_pretrained` raises `ValueError` on missing or unexpected checkpoint keys (pass
    `output_loading_info=True` to get them reported instead) and on a `token_ordering` that is not a
    permutation of the vocabulary.
    """

    config_class = HFSpecGemma4AssistantConfig
    config: HFSpecGemma4AssistantConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["AssistantDecoderLayer"]
    # A stored copy of the tied head is redundant (tie_word_embeddings is required), not an error.
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\.weight$"]
    # attn_implementation="sdpa" (the target's loading kwargs, often) loads it as "eager" does, and changes nothing:
    # its attention is hf_specdec's own
    _supports_sdpa = True

    def __init__(self, config: HFSpecGemma4AssistantConfig):
        super().__init__(config)
        text = config.text_config
        self.model = AssistantBackbone(text)
        self.pre_projection = nn.Linear(2 * config.backbone_hidden_size, text.hidden_size, bias=False)
        self.post_projection = nn.Linear(text.hidden_size, config.backbone_hidden_size, bias=False)
        self.masked_embedding = (
            CentroidHead(text.hidden_size, text.vocab_size, config.num_centroids, config.centroid_intermediate_top_k)
            if config.use_ordered_embeddings
            else None
        )
        self.post_init()

    def draft_step(
        self,
        input_ids: torch.Tensor,  # [batch] the token fed at the draft position
        hidden: torch.Tensor,  # [batch, backbone_hidden] previous hidden state (see module doc)
        position_ids: torch.Tensor,  # [batch] the fixed draft position p of each row
        target_embed: nn.Module,  # the target's scaled input embedding, `target.get_input_embeddings()`
        kv_source: TargetKVSource,
        rope: dict | None = None,  # `draft_rope(position_ids)`: computed once for the k steps of a round
        embed_scale: float | None = None,  # `fused_embedding_scale(target_embed)`: one launch for the input
    ) -> AssistantStepOutput:
        """One draft step for every row; no host syncs, no K/V written. Differentiable (callers that only
        decode wrap it in `torch.inference_mode()`)."""
        dtype = self.pre_projection.weight.dtype
        beside = target_embed.weight.device == hidden.device == input_ids.device  # not offloaded, not elsewhere
        if embed_scale is not None and not needs_grad(hidden) and hidden.dtype == dtype and beside:
            # lookup, scale and concatenation in one kernel on the GPU (the same arithmetic)
            x = embed_concat(input_ids, target_embed.weight, embed_scale, hidden)
        else:  # the module's own forward: accelerate's hook loads an offloaded table, runs it on its device
            embeds = target_embed(input_ids).to(hidden.device, dtype)  # already x sqrt(backbone_hidden)
            x = torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1)
        x = self.pre_projection(x).unsqueeze(1)
        normed = self.model(x, position_ids.unsqueeze(1), kv_source, rope).squeeze(1)  # [batch, hidden]
        if self.masked_embedding is None or needs_grad(normed):
            return AssistantStepOutput(hidden_next=self.post_projection(normed), logits=self.draft_logits(normed))
        # post_projection and the centroid scores read the same input: one GEMM when their weights are stacked
        hidden_next, scores = stacked_projections(normed, self.post_projection, self.masked_embedding.centroids)
        return AssistantStepOutput(hidden_next=hidden_next, logits=self.draft_logits(normed, scores))

    def draft_rope(self, position_ids: torch.Tensor) -> dict:
        """The rotary (cos, sin) of every layer type at the draft positions ``position_ids`` [batch]: every
        step of a round drafts at the same position, so a drafter computes them once per round."""
        dtype = self.pre_projection.weight.dtype
        return self.model.rope_tables(torch.empty(0, dtype=dtype, device=position_ids.device), position_ids.unsqueeze(1))

    def draft_logits(self, normed: torch.Tensor, centroid_scores: torch.Tensor | None = None) -> DraftLogits:
        """Draft logits from the final-normed hidden state ``normed`` [batch, hidden], soft-capped if the text
        config asks for it (``centroid_scores``: the centroid head's scores of ``normed``, if computed)."""
        weight = self.model.embed_tokens.weight
        cap = self.config.text_config.final_logit_softcapping
        if self.masked_embedding is None:
            return DenseLogits(softcap(normed @ weight.T, cap))
        return self.masked_embedding(normed, weight, cap, centroid_scores)

    def forward(self, input_ids, hidden, position_ids, target_embed, kv_source) -> AssistantStepOutput:
        """Calling the module is one `draft_step` (so hooks, `torch.compile` and graph capture see it)."""
        return self.draft_step(input_ids, hidden, position_ids, target_embed, kv_source)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        # `init.*` skip tensors already loaded from a checkpoint.
        if isinstance(module, AssistantDecoderLayer):
            init.ones_(module.layer_scalar)
        elif isinstance(module, CentroidHead):
            init.copy_(module.token_ordering, torch.arange(module.vocab_size))
        elif isinstance(module, Gemma4TextRotaryEmbedding):
            _init_rope_buffers(module)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        report = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if not report:
            check_checkpoint_keys(info, "gemma4_assistant")
        model._check_token_ordering()
        return (model, info) if report else model

    def _check_token_ordering(self) -> None:
        if self.masked_embedding is None:
            return
        ordering = self.masked_embedding.token_ordering
        if not torch.equal(ordering.sort().values, torch.arange(ordering.numel(), device=ordering.device)):
            raise ValueError("masked_embedding.token_ordering is not a permutation of the vocabulary (broken file).")


def _init_rope_buffers(module: Gemma4TextRotaryEmbedding) -> None:
    """Recompute the per-layer-type inverse frequencies (non-persistent, so meta-initialised on load)."""
    for layer_type, rope_init_fn in module.rope_init_fns.items():
        inv_freq, _ = rope_init_fn(module.config.per_layer_config[layer_type], layer_type=layer_type)
        init.copy_(getattr(module, f"{layer_type}_inv_freq"), inv_freq)
        init.copy_(getattr(module, f"{layer_type}_original_inv_freq"), inv_freq)


def fused_embedding_scale(target_embed: nn.Module, dtype: torch.dtype) -> float | None:
    """The scale of the target's scaled embedding as a float exact in its weight's dtype (what transformers'
    ``Gemma4TextScaledWordEmbedding`` multiplies by), when its output in ``dtype`` is exactly
    ``weight[ids] * scale``; else None (``draft_step`` then calls the module). Reads the scale once (a sync)."""
    weight, scale = getattr(target_embed, "weight", None), getattr(target_embed, "embed_scale", None)
    if (type(target_embed).__name__ != "Gemma4TextScaledWordEmbedding" or not isinstance(weight, torch.Tensor)
            or not isinstance(scale, torch.Tensor) or scale.numel() != 1 or weight.dtype != dtype
            or target_embed._forward_hooks or target_embed._forward_pre_hooks or "forward" in vars(target_embed)):
        return None
    return float(scale.to(weight.dtype))


def target_embedding(target: nn.Module) -> nn.Module:
    """The module to pass as `target_embed`: the target's scaled input embedding (both Gemma 4 target classes)."""
    target_text_config(target)  # raises for non-Gemma-4 targets
    return target.get_input_embeddings()
