"""DFlash block-diffusion drafter (z-lab, arXiv 2602.06036) in the released checkpoint layout.

One draft step proposes a whole block in one forward pass:

    f      = hidden_norm(fc(cat[target hidden after each layer in target_layer_ids]))   # per accepted token
    block  = [last accepted token, mask x (block_len - 1)] at positions p .. p + block_len - 1,
             embedded with the target's input embedding (`target_block_embeddings`)
    layer l: q, k_b, v_b from input_layernorm(h) of the block; attention over
             [context K/V of layer l: rope(k_norm(k_proj(f))), v_proj(f) of every accepted token, block K/V]
             bidirectional within the block (causal for sliding layers), then the Qwen3 MLP
    hidden = norm(h)                      -> drafts = argmax target_head(hidden[:, 1:])

The state dict has no prefix (`fc`, `hidden_norm`, `norm`, `layers.i.*`) and no embedding or lm_head:
both are the target's. The model knows nothing about caches: `context_kv` computes what a cache stores
per draft layer (appended for accepted tokens only) and `draft_block` hands each layer's queries to a
`DFlashContextSource` (`DenseDFlashContext` is the dense reference; the paged cache provides another).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from hf_specdec.kernels._dispatch import needs_grad, other_hooks, use_triton
from hf_specdec.kernels.gelu_mul import silu_mul
from hf_specdec.kernels.norm_rope import qkv_norm_rope
from hf_specdec.kernels.rms_norm import rms_norm
from hf_specdec.kernels.stacked_linear import stack_weights, stacked_projections
from hf_specdec.models.loading import check_checkpoint_keys

from .configuration import DFlashConfig
from .context import DFlashContextSource
from .target import head_logits, target_block_embeddings, target_final_softcap

# Load-time key renames (applied by `from_pretrained`, never on save) for checkpoints from other trainers:
# transformers-style `encoder.{fc,output_norm_enc}`, EAGLE-style single `midlayer`.
CHECKPOINT_KEY_MAPPING = {
    r"^encoder\.fc\.": "fc.",
    r"^encoder\.output_norm_enc\.": "hidden_norm.",
    r"^midlayer\.": "layers.0.",
}


@dataclass(frozen=True)
class DraftLayerSpec:
    """What the cache needs to hold draft layer `layer_idx`'s context K/V (layers alike share a KV group)."""

    layer_idx: int
    layer_type: str  # "full_attention" or "sliding_attention"
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None  # context positions a block query may see: (p + j) - c < sliding_window
    causal_block: bool  # causal (True) or bidirectional (False) within the block


def apply_rope(
    x: torch.Tensor,  # [batch, seq, heads, head_dim]
    cos: torch.Tensor,  # [batch, seq, head_dim]
    sin: torch.Tensor,  # [batch, seq, head_dim]
) -> torch.Tensor:
    return x * cos[:, :, None] + rotate_half(x) * sin[:, :, None]


def _kernels_take(x: torch.Tensor, *modules: nn.Module) -> bool:
    """Whether the drafter's fused ops run for activations ``x`` in ``modules``: where the kernels run, without
    autograd (the kernels have no backward: a drafter in training runs the modules' own ops), for modules without
    hooks whose weights are in x's dtype (the products round to it, as the modules' do only then). Elsewhere (the
    CPU) the modules' own ops."""
    return (use_triton(x) and not needs_grad(x)
            and all(not other_hooks(m, pre=False) and not other_hooks(m, pre=True) for m in modules)
            and all(p.dtype == x.dtype for m in modules for p in m.parameters(recurse=False)))


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def qwen3_norm(norm: Qwen3RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` with its arithmetic (the normalised rows rounded to x's dtype, then times the weight) in one
    kernel where the kernels run (:func:`rms_norm` with ``then_mul``); the module elsewhere."""
    if not _kernels_take(x, norm):
        return norm(x)
    return rms_norm(x, None, norm.variance_epsilon, then_mul=norm.weight)


def _norm_rope(heads: tuple[torch.Tensor, ...], norms: tuple[Qwen3RMSNorm, ...], cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``apply_rope(norm(x), cos, sin)`` of one or two [batch, seq, heads, head_dim] tensors in one kernel
    (:func:`qkv_norm_rope` with Qwen3's rounding); the caller checked :func:`_kernels_take`."""
    first, second = heads if len(heads) == 2 else (heads[0], None)
    weights = tuple(n.weight for n in norms) + (None,) * (3 - len(norms))
    eps = tuple(n.variance_epsilon for n in norms) + (0.0,) * (3 - len(norms))
    return qkv_norm_rope(first, second, None, weights, eps, cos, sin, round_before_weight=True)[:len(heads)]


class DFlashAttention(nn.Module):
    """Qwen3 attention projections (q/k norms per head); queries come from the block only."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.causal_block = config.layer_causal(layer_idx)
        self.sliding_window = config.layer_sliding_window(layer_idx)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def key_value(
        self,
        x: torch.Tensor,  # [batch, seq, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [batch, seq, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # keys, values: [batch, seq, kv_heads, head_dim]
        shape = (*x.shape[:2], self.num_kv_heads, self.head_dim)
        if not _kernels_take(x, self.k_norm):
            return apply_rope(self.k_norm(self.k_proj(x).view(shape)), *rope), self.v_proj(x).view(shape)
        keys, values = stacked_projections(x, self.k_proj, self.v_proj)  # one GEMM when stacked
        return _norm_rope((keys.view(shape),), (self.k_norm,), *rope)[0], values.view(shape)

    def forward(
        self,
        x: torch.Tensor,  # [batch, block_len, hidden], input_layernorm applied
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin at the block positions: [batch, block_len, head_dim]
        context: DFlashContextSource,
    ) -> torch.Tensor:  # [batch, block_len, hidden]
        batch, block_len = x.shape[:2]
        q_shape = (batch, block_len, self.num_heads, self.head_dim)
        if _kernels_take(x, self.q_norm, self.k_norm):  # one GEMM for q/k/v when stacked, one kernel for their heads
            query, keys, values = stacked_projections(x, self.q_proj, self.k_proj, self.v_proj)
            kv_shape = (batch, block_len, self.num_kv_heads, self.head_dim)
            query, block_k = _norm_rope((query.view(q_shape), keys.view(kv_shape)), (self.q_norm, self.k_norm), *rope)
            block_v = values.view(kv_shape)
        else:
            query = apply_rope(self.q_norm(self.q_proj(x).view(q_shape)), *rope)
            block_k, block_v = self.key_value(x, rope)
        out = context.attend(self.layer_idx, query, block_k, block_v, scaling=self.scaling,
                             causal_block=self.causal_block, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(batch, block_len, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, rope, context: DFlashContextSource) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(qwen3_norm(self.input_layernorm, hidden_states), rope, context)
        return hidden_states + self._mlp(qwen3_norm(self.post_attention_layernorm, hidden_states))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The Qwen3 MLP: on the GPU one GEMM for gate and up when stacked and one kernel for silu(gate) * up."""
        mlp = self.mlp
        if not _kernels_take(x, mlp) or not _is_silu(mlp.act_fn):
            return mlp(x)
        return mlp.down_proj(silu_mul(*stacked_projections(x, mlp.gate_proj, mlp.up_proj)))


class DFlashDrafter(PreTrainedModel):
    """DFlash drafter in the z-lab checkpoint layout; `from_pretrained` also accepts the key aliases of
    `CHECKPOINT_KEY_MAPPING` and raises `ValueError` on missing or unexpected keys (pass
    `output_loading_info=True` to get them reported instead)."""

    config_class = DFlashConfig
    config: DFlashConfig
    base_model_prefix = "model"  # as the reference's Qwen3PreTrainedModel; the checkpoint keys have no prefix
    main_input_name = "block_embeds"
    _no_split_modules = ["DFlashDecoderLayer"]
    # Some trainers store a copy of the target's embedding/head beside the drafter: DFlash uses the target's.
    _keys_to_ignore_on_load_unexpected = [r"^embed_tokens\.weight$", r"^lm_head\.weight$"]
    # attn_implementation="sdpa" (the target's loading kwargs, often) loads it as "eager" does, and changes nothing:
    # its attention is hf_specdec's own
    _supports_sdpa = True

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.settings = config.dflash
        self.block_size = self.settings.block_size
        self.mask_token_id = self.settings.mask_token_id
        self.target_layer_ids = list(self.settings.target_layer_ids)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def stack_projections(self) -> None:
        """Each layer's q/k/v and gate/up weights back to back in one storage (same parameters and values): its
        forwards then run one GEMM for each group (:mod:`hf_specdec.kernels.stacked_linear`). Idempotent; anything
        that separates them again (``.to(...)``) only brings the per-projection GEMMs back."""
        for layer in self.layers:
            attention, mlp = layer.self_attn, layer.mlp
            stack_weights(attention.q_proj, attention.k_proj, attention.v_proj)
            stack_weights(mlp.gate_proj, mlp.up_proj)

    @property
    def layer_specs(self) -> list[DraftLayerSpec]:
        """One entry per draft layer: the shape and visibility of its context KV group."""
        return [
            DraftLayerSpec(i, self.config.layer_types[i], a.num_kv_heads, a.head_dim, a.sliding_window, a.causal_block)
            for i, a in enumerate(layer.self_attn for layer in self.layers)
        ]

    def context_features(
        self,
        target_hidden_states: Sequence[torch.Tensor],  # one [batch, n, target_hidden] per id in target_layer_ids
    ) -> torch.Tensor:  # [batch, n, hidden]
        """Fused context feature `hidden_norm(fc(cat[...]))` of each token the target processed."""
        if len(target_hidden_states) != len(self.target_layer_ids):
            raise ValueError(f"expected {len(self.target_layer_ids)} target hidden states (one per "
                             f"target_layer_ids entry), got {len(target_hidden_states)}.")
        stacked = torch.cat([h.to(self.fc.weight.dtype) for h in target_hidden_states], dim=-1)
        return qwen3_norm(self.hidden_norm, self.fc(stacked))

    def context_kv(
        self,
        layer_idx: int,
        features: torch.Tensor,  # [batch, n, hidden] from `context_features`
        position_ids: torch.Tensor,  # [batch, n] positions of those tokens
    ) -> tuple[torch.Tensor, torch.Tensor]:  # keys (RoPE applied), values: [batch, n, kv_heads, head_dim]
        """Draft layer `layer_idx`'s context K/V for these tokens: `rope(k_norm(k_proj(f)))`, `v_proj(f)`.

        A cache stores these for accepted tokens only. No layer norm precedes the projections: as in the
        reference, every draft layer projects the fused feature itself."""
        return self.layers[layer_idx].self_attn.key_value(features, self.rotary_emb(features, position_ids))

    def context_kv_all_layers(
        self,
        features: torch.Tensor,  # [batch, n, hidden]
        position_ids: torch.Tensor,  # [batch, n]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per draft layer: keys, values [batch, n, kv_heads, head_dim]
        """`context_kv` of every draft layer, with the rotary tables computed once."""
        rope = self.rotary_emb(features, position_ids)
        return [layer.self_attn.key_value(features, rope) for layer in self.layers]

    def draft_block(
        self,
        block_embeds: torch.Tensor,  # [batch, block_len, hidden]: `embed_block(...)`
        block_position_ids: torch.Tensor,  # [batch, block_len]: p, p + 1, ... with p the row's accepted count
        context: DFlashContextSource,
    ) -> torch.Tensor:  # [batch, block_len, hidden], after the final norm
        """One drafter forward over the block; no host syncs, nothing written to `context`."""
        rope = self.rotary_emb(block_embeds, block_position_ids)
        hidden_states = block_embeds.to(self.fc.weight.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, rope, context)
        return qwen3_norm(self.norm, hidden_states)

    def forward(self, block_embeds, block_position_ids, context: DFlashContextSource) -> torch.Tensor:
        """Calling the module is one `draft_block` (so hooks, `torch.compile` and graph capture see it)."""
        return self.draft_block(block_embeds, block_position_ids, context)

    def block_input_ids(
        self,
        last_tokens: torch.Tensor,  # [batch] each row's last accepted token
        num_drafts: int | None = None,  # block_len - 1; default block_size - 1
    ) -> torch.Tensor:  # [batch, num_drafts + 1]
        """`[last accepted token, mask x num_drafts]` per row. Fewer drafts than block_size - 1 shorten the
        block itself, as the reference does when it is given a smaller block."""
        num_drafts = self.block_size - 1 if num_drafts is None else num_drafts
        if not 1 <= num_drafts <= self.block_size - 1:
            raise ValueError(f"num_speculative_tokens must be in [1, block_size - 1 = {self.block_size - 1}], "
                             f"got {num_drafts}.")
        masks = last_tokens.new_full((last_tokens.shape[0], num_drafts), self.mask_token_id)
        return torch.cat([last_tokens[:, None], masks], dim=1)

    def embed_block(self, target: nn.Module, block_ids: torch.Tensor) -> torch.Tensor:
        """block_ids [batch, block_len] -> [batch, block_len, hidden] with the target's embedding (see
        `target_block_embeddings`; the drafter's `input_embedding_scale`, if set, picks z-lab's raw rule)."""
        return target_block_embeddings(target, block_ids, self.settings.input_embedding_scale)

    def draft_logits(
        self,
        target: nn.Module,
        hidden: torch.Tensor,  # [batch, block_len, hidden] from `draft_block`
    ) -> torch.Tensor:  # [batch, block_len - 1, vocab]: logits of the drafts at block positions 1..
        """Target lm_head x the drafter's `output_multiplier`, soft-capped with the drafter's
        `final_logit_softcapping` if it sets one, else with the target's (Gemma 4: 30)."""
        softcap = self.settings.final_logit_softcapping or target_final_softcap(target)
        return head_logits(target, hidden[:, 1:], multiplier=self.settings.output_multiplier, softcap=softcap)

    def greedy_logits(self, target: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Logits whose argmax is :meth:`draft_logits`'s, for greedy drafts: the LM head's alone where the multiplier
        is positive (it and the soft-cap keep the order; they only cost a pass over [batch, block_len - 1, vocab],
        and their rounding could only tie two logits the raw ones rank), else :meth:`draft_logits`."""
        if self.settings.output_multiplier > 0:
            return head_logits(target, hidden[:, 1:])
        return self.draft_logits(target, hidden)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        kwargs["key_mapping"] = {**CHECKPOINT_KEY_MAPPING, **(kwargs.get("key_mapping") or {})}
        report = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if not report:
            check_checkpoint_keys(info, "DFlash")
        return (model, info) if report else model


def load_dflash_drafter(pretrained_model_name_or_path, *args, **kwargs) -> DFlashDrafter:
    """`DFlashDrafter.from_pretrained`: what `hf_specdec.AutoModelForCausalLM` returns for a DFlash checkpoint."""
    return DFlashDrafter.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
