"""Gemma 4's fused forwards, registered with ``enable`` (``generation/fusion.py``).

Norms (one kernel each, or none where the last seam of the layer before computed them), attention (q/k/v norms and
rotary in one kernel), decoder layers (post-norm, residual add, layer scalar and the next pre-norm in one kernel;
E2B/E4B's per-layer-input gate in two; a 26B-A4B MoE block's experts branch beside the dense MLP, its experts through
the experts interface, see ``generation/experts.py``) and MLPs (activation and gate product in one), with
transformers' arithmetic. Each checks at ``enable`` that the module has what it reads, and runs the module's own
forward on CPU, for the variants it does not cover, and whenever autograd tracks the input (the kernels have no
backward).
"""

from __future__ import annotations

import sys
import weakref

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextAttention,
    Gemma4TextDecoderLayer,
    Gemma4TextMLP,
    Gemma4TextModel,
    Gemma4TextRouter,
)

from hf_specdec.compat import cache_argument
from hf_specdec.generation.quantization import w8a8_input_group
from hf_specdec.generation.registry import FusedForward, register_fused_forwards, register_model_links
from hf_specdec.kernels import use_triton
from hf_specdec.kernels._dispatch import needs_grad, other_hooks, runs_own_forward, write_count
from hf_specdec.kernels.fp8_w8a8 import reshape_with_codes
from hf_specdec.kernels.fused_moe import softmax_topk_route
from hf_specdec.kernels.gelu_mul import gelu_tanh_mul, is_gelu_tanh
from hf_specdec.kernels.norm_rope import qkv_norm_rope
from hf_specdec.kernels.rms_norm import dual_norm_add, norm_add, rms_norm
from hf_specdec.kernels.stacked_linear import stacked_projections


def _gemma_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not use_triton(hidden_states) or needs_grad(hidden_states):
        return type(self).forward(self, hidden_states)  # the module's own ops: the same arithmetic, no wrapper
    normed = _computed_norm(hidden_states, self)  # by the seam that computed hidden_states (the last decoder layer's)
    if normed is not None:
        return normed
    return rms_norm(hidden_states, self.weight if self.with_scale else None, self.eps)


def _gemma4_attention_forward(self, hidden_states, position_embeddings, attention_mask, shared_kv_states=None,
                              cache=None, past_key_values=None, **kwargs):
    """transformers' ``Gemma4TextAttention.forward`` with q/k/v norms and rotary in one kernel
    (:func:`qkv_norm_rope`); a KV-shared layer normalises and rotates its query alone and attends over its
    producer layer's K/V, as transformers' does. The CPU runs the original.

    The cache comes as ``cache`` (transformers >= 5.24) or ``past_key_values`` (earlier); it goes on to the
    original forward under the name that version takes."""
    cache = cache if cache is not None else past_key_values
    if not use_triton(hidden_states) or needs_grad(hidden_states):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, shared_kv_states,
                                  **{cache_argument(type(self)): cache}, **kwargs)
    hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    if self.is_kv_shared_layer:
        query, _, _ = qkv_norm_rope(self.q_proj(hidden_states).view(hidden_shape), None, None,
                                    (self.q_norm.weight, None, None), (self.q_norm.eps, 0.0, 0.0),
                                    *position_embeddings)
        query = query.transpose(1, 2)
        key, value = (t.to(query.device) for t in shared_kv_states[self.layer_type])
    else:
        query, key, value = _gemma4_qkv(self, hidden_states, hidden_shape, position_embeddings)
        if cache is not None:  # kwargs: transformers 5.24's paged caches fill in the attention's kwargs
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    if self.store_full_length_kv:
        shared_kv_states[self.layer_type] = key, value
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, sys.modules[type(self).__module__].eager_attention_forward)
    out, weights = attention(self, query, key, value, attention_mask,
                             dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
                             sliding_window=self.sliding_window, **kwargs)
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def _gemma4_qkv(self, hidden_states, hidden_shape, position_embeddings):
    """Query, key and value [batch, heads, seq, head_dim] of a Gemma 4 attention that owns its K/V: one GEMM
    for the projections when stacked, then norms and rotary in one kernel (v = k's raw projection where the
    layer has no v_proj)."""
    projections = (self.q_proj, self.k_proj) if self.v_proj is None else (self.q_proj, self.k_proj, self.v_proj)
    query, key, *value = (p.view(hidden_shape) for p in stacked_projections(hidden_states, *projections))
    value = value[0] if value else key
    query, key, value = qkv_norm_rope(
        query, key, value, (self.q_norm.weight, self.k_norm.weight, _norm_weight(self.v_norm)),
        (self.q_norm.eps, self.k_norm.eps, self.v_norm.eps), *position_embeddings)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _gemma4_decoder_layer_forward(self, hidden_states, per_layer_input=None, shared_kv_states=None,
                                  position_embeddings=None, attention_mask=None, position_ids=None,
                                  cache=None, past_key_values=None, **kwargs):
    """transformers' ``Gemma4TextDecoderLayer.forward`` with its norm/residual seams fused (:func:`norm_add`):
    post-attention norm + residual add + pre-feedforward norm in one launch, post-feedforward norm + residual
    add + layer scalar in another. A per-layer-input block (E2B, E4B) puts its gate between the last two:
    gelu(gate(h)) * per_layer_input in one launch (:func:`gelu_tanh_mul`), then its projection's post-norm +
    residual add + layer scalar in one. An MoE block (26B-A4B) takes its experts' pre-norm and its router's input from
    the first seam too (more outputs of the same launch, :func:`_router_seam`) and ends in one launch for both
    branches' post-norms, their sum, the block's post-norm, the residual add and the layer scalar
    (:func:`dual_norm_add`). The last seam also computes the norm that reads the layer's output next (see
    CROSS_LAYER_SEAMS). The CPU runs the original.

    The cache comes as ``cache`` or ``past_key_values`` and goes on by keyword, under the name the original
    takes: transformers 5.24's gradient checkpointing drops a keyword cache before the recompute."""
    cache = cache if cache is not None else past_key_values
    per_layer = bool(self.hidden_size_per_layer_input)
    if (not use_triton(hidden_states) or needs_grad(hidden_states)
            or (per_layer and (per_layer_input is None or per_layer_input.dtype != hidden_states.dtype))):
        return type(self).forward(self, hidden_states, per_layer_input, shared_kv_states, position_embeddings,
                                  attention_mask, position_ids, **{cache_argument(type(self)): cache}, **kwargs)
    # the dict of shared K/V by keyword: accelerate's hook (device_map) copies a positional one, and the producers'
    # entries written into the copy would be lost (it passes keyword arguments of the model's skip keys through)
    attn, _ = self.self_attn(_input_norm(self, hidden_states), position_embeddings, attention_mask,
                             shared_kv_states=shared_kv_states, position_ids=position_ids,
                             **{cache_argument(type(self.self_attn)): cache}, **kwargs)
    post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
    mlp = self.mlp
    seam = dict(next_weight=_norm_weight(pre), next_eps=pre.eps,
                next_quantize_group=w8a8_input_group(attn, getattr(mlp, "gate_proj", None),
                                                     getattr(mlp, "up_proj", None)))
    if self.enable_moe_block:  # the experts' pre-norm reads the same sum as the dense MLP's, and the router's too
        seam.update(next2_weight=_norm_weight(self.pre_feedforward_layernorm_2),
                    next2_eps=self.pre_feedforward_layernorm_2.eps,
                    next2_quantize_group=w8a8_input_group(attn, self.experts), **_router_seam(self.router, attn))
    hidden_states, mlp_in, *experts_in = norm_add(attn, hidden_states, post.weight, post.eps, **seam)
    post = self.post_feedforward_layernorm
    scale = None if per_layer else self.layer_scalar
    # the last seam also computes the norm that reads the layer's output next (the next layer's input norm, or the
    # final norm), so that norm runs no launch of its own
    following, group = _following_norm(self, hidden_states)
    last = {} if following is None else dict(next_weight=_norm_weight(following), next_eps=following.eps)
    if self.enable_moe_block:
        mlp_out, routed = _parallel_branches(self, mlp_in, hidden_states, *experts_in)
        dense_post, experts_post = self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2
        hidden_states, normed = dual_norm_add(
            mlp_out, dense_post.weight, dense_post.eps, routed, experts_post.weight, experts_post.eps, hidden_states,
            post.weight, post.eps, scale=scale, **({} if per_layer or group is not None else last))
    else:
        hidden_states, normed = norm_add(self.mlp(mlp_in), hidden_states, post.weight, post.eps, scale=scale,
                                         **({} if per_layer else dict(last, next_quantize_group=group)))
    if per_layer:
        gated = gelu_tanh_mul(self.per_layer_input_gate(hidden_states), per_layer_input)
        post = self.post_per_layer_input_norm
        hidden_states, normed = norm_add(self.per_layer_projection(gated), hidden_states, post.weight, post.eps,
                                         scale=self.layer_scalar, **dict(last, next_quantize_group=group))
    if normed is not None:
        setattr(hidden_states, _NORMED, (following, write_count(hidden_states), normed))
    return hidden_states


def _input_norm(self, hidden_states):
    """The layer's input norm; where its attention's projections are FP8 products that quantize their rows (W8A8),
    the norm's kernel writes the codes beside its output for them (``rms_norm``'s ``quantize_group``)."""
    norm = self.input_layernorm
    group = _input_group(self, hidden_states)
    if group is None or norm._forward_hooks or norm._forward_pre_hooks:  # a hooked norm runs as a module
        return norm(hidden_states)
    normed = _computed_norm(hidden_states, norm)  # by the last layer's seam, with the codes (_following_norm)
    if normed is not None:
        return normed
    return rms_norm(hidden_states, _norm_weight(norm), norm.eps, quantize_group=group)


def _input_group(self, hidden_states):
    """The values per scale in which a decoder layer's attention projections quantize its input norm's rows (W8A8),
    or None (:func:`w8a8_input_group`)."""
    attention = self.self_attn
    return w8a8_input_group(hidden_states, attention.q_proj, getattr(attention, "k_proj", None),
                            getattr(attention, "v_proj", None))


# Cross-layer seams: a decoder layer's last seam (norm_add, dual_norm_add) also computes the norm that reads the
# layer's output next -- the next layer's input norm, or the text model's final norm (_link_following_norms) -- and
# attaches it to its output; that norm then returns it instead of launching (_computed_norm): one launch less a layer.
# Only where nothing can change the output in between: no hook on the layer but hf_specdec's device guards and an
# accelerate hook that only moves inputs to the layer's GPU (runs_own_forward; a device_map's: a tensor it moves to
# another GPU is a new tensor, without the attached norm), no global hook, no forward pre-hook on the next layer, the
# norm's weight on the output's device. CROSS_LAYER_SEAMS = False (set at run time, with the graphs captured before
# released) keeps the norms' own launches, e.g. to compare the two.
CROSS_LAYER_SEAMS = True
_FOLLOWING: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_NORMED = "_hf_specdec_normed"  # on a layer's output: (the norm, the output's version, that norm's output)


def _link_following_norms(model) -> None:
    """Each decoder layer of each Gemma 4 text model in ``model`` -> (the norm that reads its output next, the layer
    it belongs to or None for the final norm), as weak references."""
    for module in model.modules():
        if isinstance(module, Gemma4TextModel):
            layers = list(module.layers)[:module.config.num_hidden_layers]
            for layer, following in zip(layers, layers[1:] + [None]):
                norm = module.norm if following is None else following.input_layernorm
                _FOLLOWING[layer] = (weakref.ref(norm), None if following is None else weakref.ref(following))


def _unlink_following_norms(model) -> None:
    for module in model.modules():
        _FOLLOWING.pop(module, None)


def _following_norm(self, hidden_states):
    """(the norm that reads this layer's output next, the values per scale its output's codes take or None) where the
    layer's last seam may compute it (see CROSS_LAYER_SEAMS), else (None, None)."""
    entry = _FOLLOWING.get(self)
    if entry is None or not CROSS_LAYER_SEAMS or runs_own_forward(self) or _global_hooks():
        return None, None
    norm, layer = entry[0](), entry[1] and entry[1]()
    if (norm is None or type(norm) is not Gemma4RMSNorm or (layer is not None and other_hooks(layer, pre=True))
            or (norm.with_scale and norm.weight.device != hidden_states.device)):
        return None, None
    return norm, None if layer is None else _input_group(layer, hidden_states)


def _global_hooks() -> bool:
    """Whether a global forward (pre-)hook is set: every module's call is then seen, and none may be skipped."""
    return bool(torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks)


def _computed_norm(hidden_states, norm):
    """``norm``'s output of ``hidden_states`` where the seam that computed hidden_states computed it too (and nothing
    wrote hidden_states since, where torch counts writes), else None."""
    found = getattr(hidden_states, _NORMED, None)
    if found is None or found[0] is not norm or found[1] != write_count(hidden_states):
        return None
    return found[2]


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _parallel_branches(self, mlp_in, residual, experts_in, router_in=None):
    """An MoE block's two branches: the dense MLP and the routed experts (outputs before their post-norms). On
    CUDA the dense MLP runs on a second stream beside the router and the experts (forked from and joined to
    the current stream, so CUDA graphs capture both branches): each branch is a few small bandwidth-bound
    launches whose ramps and tails leave the GPU part idle, and the other branch fills them. Elsewhere, one
    after the other."""
    if not mlp_in.is_cuda:
        return self.mlp(mlp_in), _experts_branch(self, residual, experts_in, router_in)
    main = torch.cuda.current_stream(mlp_in.device)
    side = _side_streams.get(mlp_in.device)
    if side is None:
        side = _side_streams[mlp_in.device] = torch.cuda.Stream(mlp_in.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        mlp_out = self.mlp(mlp_in)
    routed = _experts_branch(self, residual, experts_in, router_in)
    main.wait_stream(side)
    # mlp_out's memory came from the side stream's pool: it must not be reused there before the main stream is
    # done reading it (outside graph capture; a captured graph's pool is not reused while it lives)
    if not torch.cuda.is_current_stream_capturing():
        mlp_out.record_stream(main)
    return mlp_out, routed


def _experts_branch(self, residual, experts_in, router_in=None):
    """An MoE block's experts output before its post-norm: routed from the residual (transformers' order), run
    on the pre-normed input through the model's experts implementation (on CUDA, fused_moe). ``router_in``: the
    router's normed and scaled input where the seam computed it (:func:`_router_seam`)."""
    flat = residual.reshape(-1, residual.shape[-1])
    if router_in is None:
        _, top_k_weights, top_k_index = self.router(flat)
    else:
        _, top_k_weights, top_k_index = _route(self.router, router_in.reshape(flat.shape))
    return self.experts(reshape_with_codes(experts_in, flat.shape), top_k_index, top_k_weights).reshape(
        residual.shape)


def _gemma4_router_forward(self, hidden_states):
    """transformers' ``Gemma4TextRouter.forward`` in three launches: the input norm with its scale and
    ``hidden_size ** -0.5`` (one kernel, each product rounded as eager torch rounds it), the projection, and the
    fp32 softmax + top-k + renormalise + per-expert scale (:func:`softmax_topk_route`, one kernel: the same
    experts but at near-ties, the probabilities and weights within a few ulps). The CPU runs the original."""
    if not use_triton(hidden_states) or needs_grad(hidden_states) or self.scale.dtype != hidden_states.dtype:
        return type(self).forward(self, hidden_states)
    normed = rms_norm(hidden_states, None, self.norm.eps, then_mul=self.scale, then_scalar=self.scalar_root_size,
                      quantize_group=w8a8_input_group(hidden_states, self.proj))
    return _route(self, normed)


def _route(router, normed):
    """A Gemma 4 router's projection of its normed and scaled input, then its fp32 softmax + top-k + renormalise +
    per-expert scale (one kernel): (probabilities, top-k weights, top-k experts)."""
    return softmax_topk_route(router.proj(normed), router.config.top_k_experts, router.per_expert_scale,
                              return_probabilities=True)


# An MoE block's router input (its unscaled norm of the residual, times its scale and hidden_size ** -0.5) is a third
# output of the seam before the block (norm_add's next3): one launch less a layer, on the experts' path. Only where
# nothing can see that the router's own forward is skipped: the router runs the fused forward (directly, or under an
# accelerate hook that only moves inputs to its GPU), no other hook on it (transformers' output-capturing hooks turn
# it off for good once installed), no global hook. Not where its projection quantizes its rows (W8A8): the seam
# writes no codes for it, and the router's own norm would. ROUTER_IN_SEAM = False (set at run time, with the graphs
# captured before released) keeps the router's own norm launch, e.g. to compare the two.
ROUTER_IN_SEAM = True


def _router_seam(router, hidden_states) -> dict:
    """norm_add's third-norm arguments that compute ``router``'s input in the seam, or {} where it runs its own."""
    if not ROUTER_IN_SEAM or runs_own_forward(router) or _global_hooks():
        return {}
    # accelerate's hook (device_map) wraps the forward, the fused one kept as its _old_forward
    forward = vars(router).get("_old_forward" if getattr(router, "_hf_hook", None) is not None else "forward")
    if (getattr(forward, "__func__", None) is not _gemma4_router_forward or forward.__self__ is not router
            or w8a8_input_group(hidden_states, router.proj) is not None
            or router.scale.dtype != hidden_states.dtype or router.scale.device != hidden_states.device):
        return {}
    return dict(next3_eps=router.norm.eps, next3_mul=router.scale, next3_scalar=router.scalar_root_size)


def gemma4_mlp_forward(self, x):
    """transformers' ``Gemma4TextMLP.forward`` with the activation and the product in one launch (which also
    quantizes its rows where the down projection is a W8A8 product, see :func:`_input_norm`)."""
    if not use_triton(x) or needs_grad(x):
        return type(self).forward(self, x)
    gate, up = stacked_projections(x, self.gate_proj, self.up_proj)
    return self.down_proj(gelu_tanh_mul(gate, up, quantize_group=w8a8_input_group(gate, self.down_proj)))


def _fusible_gemma4_mlp(module) -> bool:
    return (all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj"))
            and is_gelu_tanh(getattr(module, "act_fn", None)))


def _fusible_gemma4_decoder_layer(module) -> bool:
    names = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm", "layer_scalar", "enable_moe_block", "hidden_size_per_layer_input")
    return (all(hasattr(module, n) for n in names)
            and all(type(getattr(module, n)) is Gemma4RMSNorm for n in names[2:6])
            and module.post_attention_layernorm.with_scale and module.post_feedforward_layernorm.with_scale
            and (not module.hidden_size_per_layer_input or _fusible_per_layer_input(module))
            and (not module.enable_moe_block or _fusible_moe_block(module)))


def _fusible_moe_block(module) -> bool:
    """What the fused MoE branch reads: the router, the experts and three norms (both post-norms scaled)."""
    norms = ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")
    return (all(hasattr(module, n) for n in ("router", "experts", *norms))
            and all(type(getattr(module, n)) is Gemma4RMSNorm for n in norms)
            and module.post_feedforward_layernorm_1.with_scale and module.post_feedforward_layernorm_2.with_scale)


def _fusible_gemma4_router(module) -> bool:
    """What the fused router reads (transformers 5.17+): an unscaled norm, its scale and the per-expert scale."""
    return (all(hasattr(module, n) for n in ("norm", "proj", "scale", "per_expert_scale", "scalar_root_size",
                                             "config"))
            and type(module.norm) is Gemma4RMSNorm and not module.norm.with_scale
            and isinstance(module.proj, torch.nn.Linear) and module.proj.bias is None
            and isinstance(getattr(module.config, "top_k_experts", None), int))


def _fusible_per_layer_input(module) -> bool:
    """What the fused per-layer-input gate reads: its two projections, a tanh GELU and a scaled post-norm."""
    norm = getattr(module, "post_per_layer_input_norm", None)
    return (all(hasattr(module, n) for n in ("per_layer_input_gate", "per_layer_projection"))
            and is_gelu_tanh(getattr(module, "act_fn", None))
            and type(norm) is Gemma4RMSNorm and norm.with_scale)


def _norm_weight(norm):
    return norm.weight if norm.with_scale else None


def _fusible_gemma4_attention(module) -> bool:
    """The attributes the fused forward reads (transformers 5.17+); anything else keeps its own forward. A
    KV-shared layer has no k/v projections or norms of its own."""
    names = ("q_proj", "o_proj", "q_norm", "head_dim", "layer_idx", "layer_type", "scaling", "sliding_window",
             "is_kv_shared_layer", "store_full_length_kv", "config", "attention_dropout")
    if not all(hasattr(module, n) for n in names):
        return False
    norms = ("q_norm",) if module.is_kv_shared_layer else ("q_norm", "k_norm", "v_norm")
    return (all(hasattr(module, n) for n in ("k_proj", "v_proj")) or module.is_kv_shared_layer) and (
        all(type(getattr(module, n, None)) is Gemma4RMSNorm for n in norms)
        and all(getattr(module, n).with_scale for n in norms[:2])
        and hasattr(sys.modules[type(module).__module__], "eager_attention_forward"))


def register() -> None:
    """Register Gemma 4's fused forwards with ``enable`` (idempotent)."""
    register_fused_forwards(
        FusedForward(Gemma4RMSNorm, _gemma_rms_norm_forward),
        FusedForward(Gemma4TextAttention, _gemma4_attention_forward, _fusible_gemma4_attention,
                     stacked=(("q_proj", "k_proj", "v_proj"),)),
        FusedForward(Gemma4TextDecoderLayer, _gemma4_decoder_layer_forward, _fusible_gemma4_decoder_layer),
        FusedForward(Gemma4TextMLP, gemma4_mlp_forward, _fusible_gemma4_mlp, stacked=(("gate_proj", "up_proj"),)),
        FusedForward(Gemma4TextRouter, _gemma4_router_forward, _fusible_gemma4_router),
    )
    register_model_links(_link_following_norms, _unlink_following_norms)
