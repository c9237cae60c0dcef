"""A small, independent torch re-implementation of z-lab's DFlash decoding loop (batch 1, dense caches, greedy).

It mirrors `dflash_generate` + `DFlashDraftModel` of the public reference (z-lab/dflash, `dflash/model.py`)
and shares no code with `hf_specdec.models.dflash` except reading the drafter's weight tensors:

    prefill the target (output_hidden_states), first token = argmax, context = hidden[i + 1] for i in ids
    loop:  block = [token at `start`, mask x k] at positions start .. start + k
           drafter forward over [new context features, block] appending to its dense cache, then crop to
           `start` (so the cache keeps context K/V of accepted tokens only)
           drafts = argmax(target head(drafter hidden[1:]))
           verify [block token 0, drafts] with the target (DynamicCache), accept the longest matching prefix
           plus the target's next token, crop the target cache to the new `start`,
           context = target hidden of the kept tokens

Deliberate differences from `dflash_generate`: the block never shrinks near `max_new_tokens` (the shared
speculative loop always verifies k + 1 tokens; output is cut instead), and k may be < block_size - 1, in
which case the block is `[token, mask x k]` as when the reference is given a smaller `block_size`. The
target cache is a config-less `DynamicCache` (every layer keeps all K/V; sliding masks still apply) instead
of the reference's `DynamicCache(config)` + `activate_past_recording()`: same attention, and crop works on
transformers 5.17, whose recording sliding layers break multi-token verify forwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from hf_specdec.compat import cache_argument


@dataclass
class ReferenceResult:
    tokens: list[int]  # prompt + generated
    acceptance: list[int] = field(default_factory=list)  # accepted drafts per verify step (bonus not counted)


def draft_value(config, name, default=None):
    nested = getattr(config, "dflash_config", None) or {}
    value = nested.get(name, getattr(config, name, None))
    return default if value is None else value


def rms_norm(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope_cos_sin(config, positions):  # positions [seq] -> cos, sin [seq, head_dim]
    assert config.rope_parameters.get("rope_type", "default") == "default"
    theta, dim = config.rope_parameters["rope_theta"], config.head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate(x, cos, sin):  # x [..., seq, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def visible(num_queries, num_keys, *, is_causal, sliding_window):
    """z-lab `_attention_mask`: key/query *indices* in the cache (= positions for one row with no padding)."""
    query = num_keys - num_queries + torch.arange(num_queries)[:, None]
    key = torch.arange(num_keys)[None, :]
    mask = torch.ones(num_queries, num_keys, dtype=torch.bool)
    if is_causal:
        mask &= key <= query
    if sliding_window is not None:
        mask &= query - key < sliding_window
        if not is_causal:
            mask &= key - query < sliding_window
    return mask


class ReferenceDrafter:
    """z-lab's DFlash forward over the weights of a `DFlashDrafter`, with a dense per-layer K/V cache."""

    def __init__(self, drafter):
        self.config = drafter.config
        self.weights = {name: t.detach() for name, t in drafter.state_dict().items()}
        self.cache: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.config.num_hidden_layers

    def crop(self, length: int) -> None:
        self.cache = [None if kv is None else (kv[0][:, :, :length], kv[1][:, :, :length]) for kv in self.cache]

    def forward(self, target_hidden, noise, positions):
        """target_hidden [1, n, L*h] of the tokens new to the cache, noise [1, T, h], positions [n + T]."""
        w, c = self.weights, self.config
        context = rms_norm(target_hidden @ w["fc.weight"].T, w["hidden_norm.weight"], c.rms_norm_eps)
        cos, sin = rope_cos_sin(c, positions)
        hidden = noise
        for i in range(c.num_hidden_layers):
            hidden = self._layer(i, hidden, context, cos, sin)
        return rms_norm(hidden, w["norm.weight"], c.rms_norm_eps)

    def _layer(self, i, hidden, context, cos, sin):
        w, c, p = self.weights, self.config, f"layers.{i}."
        x = rms_norm(hidden, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        hidden = hidden + self._attention(i, x, context, cos, sin) @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(hidden, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        return hidden + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    def _attention(self, i, x, context, cos, sin):
        w, c, p = self.weights, self.config, f"layers.{i}.self_attn."
        T, d, heads, kv_heads = x.shape[1], c.head_dim, c.num_attention_heads, c.num_key_value_heads
        q = rms_norm((x @ w[p + "q_proj.weight"].T).view(1, T, heads, d), w[p + "q_norm.weight"], c.rms_norm_eps)
        kv_in = torch.cat([context, x], dim=1)
        k = (kv_in @ w[p + "k_proj.weight"].T).view(1, -1, kv_heads, d)
        k = rms_norm(k, w[p + "k_norm.weight"], c.rms_norm_eps).transpose(1, 2)
        v = (kv_in @ w[p + "v_proj.weight"].T).view(1, -1, kv_heads, d).transpose(1, 2)
        q, k = rotate(q.transpose(1, 2), cos[-T:], sin[-T:]), rotate(k, cos, sin)
        if self.cache[i] is not None:
            k, v = torch.cat([self.cache[i][0], k], dim=2), torch.cat([self.cache[i][1], v], dim=2)
        self.cache[i] = (k, v)
        layer_type = c.layer_types[i]
        is_causal = layer_type == "sliding_attention" if c.is_causal is None else bool(c.is_causal)
        window = c.sliding_window if layer_type == "sliding_attention" else None
        mask = visible(T, k.shape[2], is_causal=is_causal, sliding_window=window)
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        scores = (q @ k.transpose(-1, -2)).float() * d**-0.5
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
        return (probs @ v).transpose(1, 2).reshape(1, T, heads * d)


def embed(target, drafter_config, ids):
    scale = draft_value(drafter_config, "input_embedding_scale")
    if scale is not None:
        return F.embedding(ids, target.get_input_embeddings().weight) * float(scale)
    return target.get_input_embeddings()(ids)  # Gemma 4: its scaled embedding; Llama/Qwen3: the plain table


def draft_logits(target, drafter_config, hidden):
    logits = target.get_output_embeddings()(hidden) * float(draft_value(drafter_config, "output_multiplier", 1.0))
    cap = draft_value(drafter_config, "final_logit_softcapping")
    cap = cap or getattr(target.config.get_text_config(), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def features(output, layer_ids):
    return torch.cat([output.hidden_states[i + 1] for i in layer_ids], dim=-1)


def crop_to(cache, length):
    cache.crop(-(cache.get_seq_length() - length))


@torch.inference_mode()
def reference_dflash_generate(target, drafter, input_ids, max_new_tokens, num_speculative_tokens=None,
                              eos_token_id=None) -> ReferenceResult:
    """Greedy DFlash decoding of `input_ids` [1, n]; stops after `max_new_tokens` or at `eos_token_id`."""
    config = drafter.config
    layer_ids = draft_value(config, "target_layer_ids")
    mask_id = draft_value(config, "mask_token_id")
    k = num_speculative_tokens or int(draft_value(config, "block_size", 16)) - 1
    ref = ReferenceDrafter(drafter)
    target_cache = DynamicCache()
    # 1. prefill: first token, and the context features of every prompt token
    n = input_ids.shape[1]
    output = target(input_ids, position_ids=torch.arange(n)[None], **{cache_argument(target): target_cache},
                    use_cache=True, output_hidden_states=True)
    result = ReferenceResult(tokens=input_ids[0].tolist() + [int(output.logits[0, -1].argmax())])
    context, start = features(output, layer_ids), n
    while not done(result.tokens, n, max_new_tokens, eos_token_id):
        # 2. draft: the new context and the block through the drafter; its cache keeps the context only
        block = torch.tensor([[result.tokens[start]] + [mask_id] * k])
        positions = torch.arange(start - context.shape[1], start + k + 1)
        hidden = ref.forward(context, embed(target, config, block), positions)[:, 1:]
        ref.crop(start)
        block[0, 1:] = draft_logits(target, config, hidden)[0].argmax(-1)
        # 3. verify [token at start, drafts] in one target forward; accept the longest matching prefix
        output = target(block, position_ids=torch.arange(start, start + k + 1)[None],
                        **{cache_argument(target): target_cache}, use_cache=True, output_hidden_states=True)
        posterior = output.logits[0].argmax(-1)
        accepted = int((block[0, 1:] == posterior[:-1]).long().cumprod(0).sum())
        result.acceptance.append(accepted)
        emit(result.tokens, block[0, 1:accepted + 1].tolist() + [int(posterior[accepted])], n, max_new_tokens,
             eos_token_id)
        # 4. commit: the target keeps the accepted tokens, their features become the next context
        start += accepted + 1
        crop_to(target_cache, start)
        context = features(output, layer_ids)[:, :accepted + 1]
    return result


def done(tokens, prompt_len, max_new_tokens, eos_token_id) -> bool:
    return len(tokens) - prompt_len >= max_new_tokens or tokens[-1] == eos_token_id


def emit(tokens, new, prompt_len, max_new_tokens, eos_token_id) -> None:
    """Append `new` token by token, stopping inside the chunk at max length or EOS."""
    for token in new:
        tokens.append(token)
        if done(tokens, prompt_len, max_new_tokens, eos_token_id):
            return
