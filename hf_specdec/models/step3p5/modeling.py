"""``Step3p5ForCausalLM``: the Step 3.5 target with its own MTP layers, on transformers' hooks.

Module tree = checkpoint layout (``stepfun-ai/Step-3.5-Flash``)::

    model.embed_tokens, model.norm, lm_head
    model.layers.{i}              i < L   decoder layer: self_attn.{q,k,v,o,g}_proj, self_attn.{q,k}_norm,
                                          input_layernorm, post_attention_layernorm, and either
                                          mlp.{gate,up,down}_proj (dense) or moe.gate, moe.router_bias,
                                          moe.{gate,up,down}_proj [E, out, in] + share_expert.*
    model.layers.{L+k}            k < M   MTP layer k: enorm, hnorm, eh_proj, shared_head.{norm,head}
                                          and its block's weights stored flat beside them

Contracts the rest of hf_specdec relies on:
- Attention goes through ``ALL_ATTENTION_FUNCTIONS`` and ``cache.update(k, v, layer_idx)``;
  every extra kwarg of ``forward`` / ``mtp_step`` reaches the attention function. Masks are built with
  ``create_causal_mask`` / ``create_sliding_window_causal_mask``, or taken from a dict
  ``{layer_type: mask}``.
- MTP layer k attends with ``layer_idx = L + k`` (its own KV group in a paged cache).
- ``forward(..., output_pre_norm_hidden_states=True)`` also returns the last decoder layer's output
  before ``model.norm`` (``pre_norm_hidden_state``), the input of MTP step 0; no second pass.
- ``mtp_step(k, input_ids, previous_hidden_states, ...)`` runs MTP layer k once and returns its logits
  (from layer k's own ``shared_head``) and its pre-norm output, the ``previous_hidden_states`` of step k+1.
- ``from_pretrained`` accepts ``shared_head.output`` for ``shared_head.head`` and drops MTP layers whose
  weights the checkpoint lacks (``has_mtp`` tells whether any remain).
- The cache argument is ``cache`` or ``past_key_values`` (transformers renamed it in 5.24; both are taken with
  every version); outputs carry it under the installed transformers' name (``CACHE_FIELD``).

Not verified against a real checkpoint (none can be downloaded here):
- Routed experts run in the activation dtype with fp32 accumulation; StepFun's reference code runs
  them in fp32 (vLLM in bf16). The router itself is fp32 in every case.
- vLLM's MTP loader also strips a ``.transformer.`` infix and skips per-MTP-layer ``embed_tokens``
  copies; no public Step 3.5 checkpoint is known to use either, so neither is mapped here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, ModelOutput
from transformers.utils import can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from hf_specdec.compat import CACHE_FIELD, either_cache
from hf_specdec.models.step3p5.configuration import SLIDING, Step3p5Config
from hf_specdec.models.step3p5.layers import (
    Step3p5Attention,
    Step3p5ExpertLinear,
    Step3p5MLP,
    Step3p5MoE,
    Step3p5RMSNorm,
    Step3p5RotaryEmbedding,
    layer_inv_freq,
)
from hf_specdec.runtime.distributed import LOCAL_SHARDS_ALL_REDUCE, register_parallel_styles

logger = logging.get_logger(__name__)

# Load-time key renames (applied by `from_pretrained`, never on save): some Step 3.5 checkpoints
# spell the MTP head `shared_head.output`.
CHECKPOINT_KEY_MAPPING = {r"\.shared_head\.output\.": ".shared_head.head."}

# Tensor parallelism (``from_pretrained(..., tp_plan="auto")``): attention heads, the head-wise gate and every MLP's
# intermediate dim split over the ranks (MTP blocks alike: they sit in the same ``layers``). Routed experts are
# sharded too, each along its intermediate dim: they are nearly all of Step 3.5's weights, so replicating them
# would leave each rank holding almost the whole model. Their packed ``[E, out, in]`` weights go to one fused
# kernel, not through a Linear forward that transformers' styles wrap, so the MoE module runs on the local shards
# and sums its output over the ranks (``local_shards_all_reduce``); the fp32 router stays replicated, so every
# rank routes alike. The embedding is split over the vocabulary.
BASE_MODEL_TP_PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.g_proj": "colwise",
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "layers.*.share_expert.gate_proj": "colwise",
    "layers.*.share_expert.up_proj": "colwise",
    "layers.*.share_expert.down_proj": "rowwise",
    "layers.*.moe.gate_proj.weight": "colwise",
    "layers.*.moe.up_proj.weight": "colwise",
    "layers.*.moe.down_proj.weight": "rowwise",
    "layers.*.moe": LOCAL_SHARDS_ALL_REDUCE,
    "layers.*.shared_head.head": "colwise_gather_output",
}
register_parallel_styles()

@dataclass
class Step3p5ModelOutputWithPast(BaseModelOutputWithPast):
    """``pre_norm_hidden_state`` [batch, seq, hidden]: last decoder layer output before ``model.norm``."""

    pre_norm_hidden_state: torch.FloatTensor | None = None


@dataclass
class Step3p5CausalLMOutputWithPast(CausalLMOutputWithPast):
    """``pre_norm_hidden_state`` [batch, seq, hidden] (all positions, not sliced by ``logits_to_keep``)."""

    pre_norm_hidden_state: torch.FloatTensor | None = None


@dataclass
class Step3p5MTPOutput(ModelOutput):
    """One MTP step: ``logits`` [batch, kept, vocab] from the layer's own head, ``hidden_state``
    [batch, seq, hidden] its pre-norm output (feed it to the next step)."""

    logits: torch.FloatTensor | None = None
    hidden_state: torch.FloatTensor | None = None
    if CACHE_FIELD == "cache":  # the field transformers' own outputs have (5.24 renames `past_key_values=`)
        cache: Cache | None = None
    else:
        past_key_values: Cache | None = None


class Step3p5DecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: gated attention, then a dense MLP or routed experts + shared expert."""

    def __init__(self, config: Step3p5Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_type = config.layer_type(layer_idx)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Step3p5Attention(config, layer_idx)
        self.input_layernorm = Step3p5RMSNorm(h, eps)
        self.post_attention_layernorm = Step3p5RMSNorm(h, eps)
        shared_limit = config.layer_swiglu_limit(layer_idx, shared=True)
        if config.is_moe_layer(layer_idx):
            self.moe = Step3p5MoE(config, config.layer_swiglu_limit(layer_idx, shared=False))
            self.share_expert = Step3p5MLP(h, config.share_expert_dim, shared_limit)
        else:
            self.mlp = Step3p5MLP(h, config.intermediate_size, shared_limit)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        if hasattr(self, "moe"):
            return self.moe(x) + self.share_expert(x)
        return self.mlp(x)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values: Cache | None = None, **kwargs) -> torch.Tensor:
        """hidden_states [batch, seq, hidden] -> [batch, seq, hidden]."""
        attn_out, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                                     past_key_values=past_key_values, **kwargs)
        hidden_states = hidden_states + attn_out
        return hidden_states + self.feed_forward(self.post_attention_layernorm(hidden_states))


class Step3p5SharedHead(nn.Module):
    """An MTP layer's own output head: ``head(norm(h))``. Never tied to ``lm_head``."""

    def __init__(self, config: Step3p5Config):
        super().__init__()
        self.norm = Step3p5RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        return self.head(self.norm(hidden_states))


class Step3p5MTPLayer(Step3p5DecoderLayer):
    """MTP layer: ``block(eh_proj(cat[enorm(embed(token)), hnorm(h_prev)]))`` + its own shared head.

    The block (attention + MLP) is the inherited decoder layer, so its weights sit flat beside
    ``enorm``/``hnorm``/``eh_proj``/``shared_head`` exactly as in the checkpoint.
    """

    def __init__(self, config: Step3p5Config, layer_idx: int):
        super().__init__(config, layer_idx)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = Step3p5RMSNorm(h, eps)
        self.hnorm = Step3p5RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = Step3p5SharedHead(config)

    def forward(self, inputs_embeds: torch.Tensor, previous_hidden_states: torch.Tensor, position_embeddings=None,
                attention_mask=None, past_key_values: Cache | None = None, **kwargs) -> torch.Tensor:
        """inputs_embeds, previous_hidden_states [batch, seq, hidden] -> pre-norm h_k [batch, seq, hidden]."""
        fused = torch.cat([self.enorm(inputs_embeds), self.hnorm(previous_hidden_states)], dim=-1)
        return super().forward(self.eh_proj(fused), position_embeddings, attention_mask,
                               past_key_values=past_key_values, **kwargs)


def add_mtp_cache_layers(cache: DynamicCache, config: Step3p5Config) -> DynamicCache:
    """Give a ``DynamicCache`` built for the main layers one layer per MTP layer (idempotent)."""
    if getattr(cache, "layer_class_to_replicate", None) is not None:
        return cache  # lazily grown cache: update() creates the layers
    for i in range(len(cache.layers), config.num_total_layers):
        if i < config.num_hidden_layers:
            raise ValueError(f"cache has {len(cache.layers)} layers, the model {config.num_hidden_layers}")
        window = config.layer_sliding_window(i)
        cache.layers.append(DynamicSlidingWindowLayer(sliding_window=window) if window else DynamicLayer())
    return cache


class Step3p5PreTrainedModel(PreTrainedModel):
    config_class = Step3p5Config
    config: Step3p5Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Step3p5DecoderLayer", "Step3p5MTPLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": Step3p5DecoderLayer, "attentions": Step3p5Attention}
    # The router runs in fp32 (StepFun keeps `router_bias` fp32): a bf16 bias would change expert selection.
    _keep_in_fp32_modules_strict = ["moe.gate.weight", "moe.router_bias"]

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Step3p5RMSNorm):
            init.zeros_(module.weight)  # zero-centred: scale 1 + 0
        elif isinstance(module, Step3p5ExpertLinear):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, Step3p5MoE):
            init.zeros_(module.router_bias)
        elif isinstance(module, Step3p5RotaryEmbedding):
            for kind, layer in enumerate(module.kind_layer):
                init.copy_(getattr(module, f"inv_freq_{kind}"), layer_inv_freq(module.config, layer))


class Step3p5Model(Step3p5PreTrainedModel):
    """Embedding, ``L`` decoder layers, final norm, and the ``M`` MTP layers (run only by ``mtp_forward``)."""

    _tp_plan = BASE_MODEL_TP_PLAN

    def __init__(self, config: Step3p5Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        main = [Step3p5DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        mtp = [Step3p5MTPLayer(config, i) for i in range(config.num_hidden_layers, config.num_total_layers)]
        self.layers = nn.ModuleList(main + mtp)
        self.norm = Step3p5RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Step3p5RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    @property
    def mtp_layers(self) -> list[Step3p5MTPLayer]:
        return list(self.layers)[self.config.num_hidden_layers:]

    def new_cache(self) -> DynamicCache:
        """A ``DynamicCache`` that knows the sliding layers, MTP layers included."""
        return add_mtp_cache_layers(DynamicCache(config=self.config), self.config)

    def _position_embeddings(self, x: torch.Tensor, position_ids: torch.Tensor, layer_indices) -> dict:
        """``{layer_idx: (cos, sin) or None}``; each RoPE kind is computed once."""
        tables, out = {}, {}
        for i in layer_indices:
            if not self.config.layer_uses_rope(i):
                out[i] = None
                continue
            kind = self.rotary_emb.layer_kind[i]
            if kind not in tables:
                tables[kind] = self.rotary_emb(x, position_ids, kind)
            out[i] = tables[kind]
        return out

    def _mask(self, layer_type: str, inputs_embeds, attention_mask, cache, position_ids, layer_idx=None):
        if isinstance(attention_mask, dict):
            return attention_mask[layer_type]
        build = create_sliding_window_causal_mask if layer_type == SLIDING else create_causal_mask
        return build(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                     position_ids=position_ids, layer_idx=layer_idx, **{CACHE_FIELD: cache})

    @staticmethod
    def _default_position_ids(inputs_embeds, cache, layer_idx: int = 0) -> torch.Tensor:
        past = cache.get_seq_length(layer_idx) if cache is not None else 0
        return (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past).unsqueeze(0)

    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask=None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.FloatTensor | None = None, use_cache: bool | None = None,
                output_pre_norm_hidden_states: bool = False, past_key_values: Cache | None = None,
                **kwargs) -> Step3p5ModelOutputWithPast:
        """Main decoder stack only (MTP layers are not run). ``kwargs`` reach the attention function."""
        cache = either_cache(cache, past_key_values)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = self.new_cache()
        if position_ids is None:
            position_ids = self._default_position_ids(inputs_embeds, cache)

        num_layers = self.config.num_hidden_layers
        masks = {t: self._mask(t, inputs_embeds, attention_mask, cache, position_ids)
                 for t in set(self.config.layer_types)}
        rope = self._position_embeddings(inputs_embeds, position_ids, range(num_layers))
        hidden_states = inputs_embeds
        for layer in self.layers[:num_layers]:
            hidden_states = layer(hidden_states, rope[layer.layer_idx], masks[layer.attention_type],
                                  past_key_values=cache, position_ids=position_ids, **kwargs)
        return Step3p5ModelOutputWithPast(
            last_hidden_state=self.norm(hidden_states),
            pre_norm_hidden_state=hidden_states if output_pre_norm_hidden_states else None,
            **{CACHE_FIELD: cache},
        )

    def mtp_forward(self, mtp_index: int, previous_hidden_states: torch.Tensor,
                    input_ids: torch.LongTensor | None = None, inputs_embeds: torch.FloatTensor | None = None,
                    position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                    attention_mask=None, past_key_values: Cache | None = None, **kwargs) -> torch.Tensor:
        """Run MTP layer ``mtp_index`` once; returns its pre-norm output [batch, seq, hidden].

        input_ids [batch, seq] (or inputs_embeds): the tokens; previous_hidden_states [batch, seq, hidden]:
        the target's pre-norm hidden state (step 0) or the previous step's output. position_ids default
        to the layer's cache length + arange. A ``DynamicCache`` gets MTP layers added if it lacks them.
        """
        layers = self.mtp_layers
        if not 0 <= mtp_index < len(layers):
            raise ValueError(f"mtp_index {mtp_index} out of range: the model has {len(layers)} MTP layers")
        layer = layers[mtp_index]
        cache = either_cache(cache, past_key_values)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if isinstance(cache, DynamicCache):
            add_mtp_cache_layers(cache, self.config)
        if position_ids is None:
            position_ids = self._default_position_ids(inputs_embeds, cache, layer.layer_idx)
        mask = self._mask(layer.attention_type, inputs_embeds, attention_mask, cache, position_ids,
                          layer_idx=layer.layer_idx)
        rope = self._position_embeddings(inputs_embeds, position_ids, [layer.layer_idx])[layer.layer_idx]
        return layer(inputs_embeds, previous_hidden_states, rope, mask, past_key_values=cache,
                     position_ids=position_ids, **kwargs)


def _keep_last(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """Keep the last ``logits_to_keep`` positions (0 = all) or the given indices; [batch, seq, hidden]."""
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
    return hidden_states[:, logits_to_keep, :]


class Step3p5ForCausalLM(Step3p5PreTrainedModel, GenerationMixin):
    """Step 3.5 causal LM; ``generate`` decodes with the main layers, ``mtp_step`` drafts with MTP layer k."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: Step3p5Config):
        super().__init__(config)
        self.model = Step3p5Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    # ---- MTP introspection

    @property
    def num_mtp_layers(self) -> int:
        return len(self.model.mtp_layers)

    @property
    def has_mtp(self) -> bool:
        return self.num_mtp_layers > 0

    @property
    def mtp_layer_indices(self) -> list[int]:
        """Cache / attention ``layer_idx`` of each MTP layer: ``[L, L+1, ...]``."""
        return [layer.layer_idx for layer in self.model.mtp_layers]

    def new_cache(self) -> DynamicCache:
        """A ``DynamicCache`` with sliding layers and the MTP layers' own layers."""
        return self.model.new_cache()

    # ---- forward passes

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask=None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.FloatTensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                output_pre_norm_hidden_states: bool = False, past_key_values: Cache | None = None,
                **kwargs) -> Step3p5CausalLMOutputWithPast:
        """Target forward. input_ids [batch, seq] -> logits [batch, kept, vocab]; with
        ``output_pre_norm_hidden_states`` also ``pre_norm_hidden_state`` [batch, seq, hidden]."""
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=either_cache(cache, past_key_values), inputs_embeds=inputs_embeds,
                             use_cache=use_cache, output_pre_norm_hidden_states=output_pre_norm_hidden_states,
                             **kwargs)
        logits = self.lm_head(_keep_last(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return Step3p5CausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            pre_norm_hidden_state=outputs.pre_norm_hidden_state,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},  # None without a cache (item access would raise)
        )

    def mtp_step(self, mtp_index: int, input_ids: torch.LongTensor, previous_hidden_states: torch.Tensor,
                 position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                 attention_mask=None, logits_to_keep: int | torch.Tensor = 0,
                 past_key_values: Cache | None = None, **kwargs) -> Step3p5MTPOutput:
        """One draft step with MTP layer ``mtp_index`` (docs/models.md §4).

        input_ids [batch, seq]: token(s) whose successor to predict; previous_hidden_states
        [batch, seq, hidden]: target pre-norm hidden state (step 0) or ``hidden_state`` of the previous
        step. Returns logits [batch, kept, vocab] from this layer's ``shared_head`` and ``hidden_state``.
        K/V go to ``cache`` at ``layer_idx = L + mtp_index``; kwargs reach the attention function.
        """
        cache = either_cache(cache, past_key_values)
        hidden = self.model.mtp_forward(mtp_index, previous_hidden_states, input_ids=input_ids,
                                        position_ids=position_ids, cache=cache, attention_mask=attention_mask,
                                        **kwargs)
        head = self.model.mtp_layers[mtp_index].shared_head
        return Step3p5MTPOutput(logits=head(_keep_last(hidden, logits_to_keep)), hidden_state=hidden,
                                **{CACHE_FIELD: cache})

    # ---- loading

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``PreTrainedModel.from_pretrained`` + the ``shared_head.output`` rename + dropping MTP layers
        the checkpoint has no weights for (a checkpoint without MTP loads with ``has_mtp`` False)."""
        kwargs["key_mapping"] = {**CHECKPOINT_KEY_MAPPING, **(kwargs.get("key_mapping") or {})}
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *model_args,
                                              output_loading_info=True, **kwargs)
        missing = model.__dict__.pop("_missing_mtp_keys", None)
        model.drop_unloaded_mtp_layers(info["missing_keys"] if missing is None else missing)
        return (model, info) if want_info else model

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        # transformers' load-report hook (5.17-5.23): MTP weights a checkpoint lacks are not "missing"
        # (their layers get dropped), so they leave the report and go to `from_pretrained`.
        super()._adjust_missing_and_unexpected_keys(loading_info)
        prefixes = tuple(f"model.layers.{i}." for i in self.mtp_layer_indices)
        self._missing_mtp_keys = {key for key in loading_info.missing_keys if key.startswith(prefixes)}
        loading_info.missing_keys = set(loading_info.missing_keys) - self._missing_mtp_keys

    def drop_unloaded_mtp_layers(self, missing_keys) -> None:
        """Keep the longest run of MTP layers (from layer 0) whose weights all loaded; drop the rest."""
        keep = 0
        for layer in self.model.mtp_layers:
            prefix = f"model.layers.{layer.layer_idx}."
            if any(key.startswith(prefix) for key in missing_keys):
                break
            keep += 1
        if keep < self.num_mtp_layers:
            logger.warning(f"Step 3.5 checkpoint has no weights for MTP layers {keep}..{self.num_mtp_layers - 1}: "
                           f"dropped them (has_mtp={keep > 0}).")
            self.truncate_mtp_layers(keep)

    def truncate_mtp_layers(self, num_mtp_layers: int) -> None:
        """Keep only the first ``num_mtp_layers`` MTP layers (config updated to match)."""
        num_main = self.config.num_hidden_layers
        self.model.layers = nn.ModuleList(list(self.model.layers)[:num_main + num_mtp_layers])
        self.config.num_nextn_predict_layers = num_mtp_layers
        self.config.mtp_layer_types = list(self.config.mtp_layer_types or [])[:num_mtp_layers]


__all__ = [
    "Step3p5ForCausalLM", "Step3p5Model", "Step3p5PreTrainedModel", "Step3p5DecoderLayer", "Step3p5MTPLayer",
    "Step3p5SharedHead", "Step3p5MTPOutput", "Step3p5CausalLMOutputWithPast", "Step3p5ModelOutputWithPast",
    "CACHE_FIELD", "CHECKPOINT_KEY_MAPPING", "add_mtp_cache_layers",
]
