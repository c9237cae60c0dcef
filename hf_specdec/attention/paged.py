"""The ``"hf_specdec"`` attention function registered with ``transformers.AttentionInterface``.

Inside hf_specdec's generate loop every forward carries ``paged_cache=<PagedKVCache>`` as a keyword
argument, which transformers passes down to the attention function. Then the K/V of this forward are
already in the pages (``PagedKVCache.update``), and attention reads the layer's pages — a KV-shared
layer reads its producer's — applying causal and sliding-window masking itself; the mask argument is
ignored. Without ``paged_cache`` (a plain ``model(...)`` call, training, a DynamicCache) the model's
original attention runs, so an enabled model still behaves as before.

Learned softmax sinks (gpt-oss hands them over as ``s_aux``) are computed by the paged kernels: each query head's
sink logit joins its softmax's denominator.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from hf_specdec.kernels import paged_attention
from hf_specdec.kernels._dispatch import on_gpu

ATTENTION_NAME = "hf_specdec"


# attention arguments that change the scores or the softmax; the paged kernels compute none of these (a model handing
# one over is refused, not decoded with it left out)
UNSUPPORTED_TERMS = {
    "softcap": "a tanh cap on the scores",
    "position_bias": "a bias added to the scores",
    "block_indices": "sparse key blocks",
}
# the names under which a model hands its attention learned softmax sinks (one logit per query head), which it computes
SINK_TERMS = ("s_aux", "sinks")


def hf_specdec_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask, scaling: float | None = None, sliding_window: int | None = None,
                         paged_cache=None, **kwargs):
    """query [batch, heads, q_len, head_dim] -> (out [batch, q_len, heads, head_dim], None)."""
    sinks = next((kwargs[name] for name in SINK_TERMS if kwargs.get(name) is not None), None)
    if paged_cache is None or paged_cache.meta is None:
        return _fallback(module, sinks)(module, query, key, value, attention_mask,
                                        scaling=scaling, sliding_window=sliding_window, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if paged_cache.layers_seen is not None:  # a request's first forward: what the model hands over, checked once
        _check_handed(module, query, key, value, kwargs, paged_cache, sinks)
    return paged_attention_forward(paged_cache, module.layer_idx, query, scaling, sinks=sinks), None


def _check_handed(module, query, key, value, kwargs, paged_cache, sinks) -> None:
    """What a layer hands its attention and the paged kernels would not reproduce, refused: a term that changes the
    scores or the softmax, sinks that are not one per query head, K/V heads laid out by the model, values of another
    width than stored."""
    changed = [name for name in UNSUPPORTED_TERMS if kwargs.get(name) is not None]
    if changed:
        raise ValueError(
            f"{type(module).__name__} hands its attention {', '.join(changed)} ({UNSUPPORTED_TERMS[changed[0]]}), "
            "which hf_specdec's paged attention does not compute. Use the model without hf_specdec.enable()."
        )
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != query.shape[1]):
        raise ValueError(
            f"{type(module).__name__} (layer {module.layer_idx}) hands its attention sinks of shape "
            f"{tuple(sinks.shape)} for {query.shape[1]} query heads; hf_specdec's paged attention takes one sink logit "
            "per query head. Use the model without hf_specdec.enable()."
        )
    k_cache, v_cache = paged_cache.layer_pages(module.layer_idx)[:2]
    stored = k_cache.shape[-2]
    if key is not None and key.shape[1] != stored:
        raise ValueError(
            f"{type(module).__name__} (layer {module.layer_idx}) hands its attention K/V of {key.shape[1]} heads but "
            f"stores {stored}: it lays its query heads over its K/V heads itself (e.g. by tiling them), which "
            "hf_specdec's paged attention, grouping consecutive query heads over each stored head, does not "
            "reproduce. Use the model without hf_specdec.enable()."
        )
    if value is not None and value.shape[-1] != v_cache.shape[-1]:
        raise ValueError(
            f"{type(module).__name__} (layer {module.layer_idx}) hands its attention values {value.shape[-1]} wide "
            f"but stores them {v_cache.shape[-1]} wide: it attends over parts of what it stored, which hf_specdec's "
            "paged attention, reading the stored pages, does not reproduce. Use the model without hf_specdec.enable()."
        )


def paged_attention_forward(paged_cache, layer_idx: int, query: torch.Tensor, scaling: float,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this forward's queries [batch, heads, q_len, head_dim] over a layer's pages (``sinks``: one
    learned logit per query head in each query's softmax denominator).

    The model may have dropped leading query slots (Gemma 4 slices to ``logits_to_keep`` before its
    KV-shared layers): the kept slots are the last ones, so their positions follow from q_len. A layer whose pages
    live on another device (a KV-shared layer placed apart from its producer) sends its queries there and back."""
    k_cache, v_cache, block_tables, window = paged_cache.layer_pages(layer_idx)
    if paged_cache.layers_seen is not None:  # a prefill checks that every layer that stored K/V read them
        paged_cache.layers_seen[1].add(layer_idx)
    meta = paged_cache.meta_on(k_cache.device)
    q_len = query.shape[2]
    q_lens, q_pos0 = meta.q_lens, meta.q_pos0
    if q_len != meta.q_len:
        q_pos0 = q_pos0 + (meta.q_len - q_len)
        q_lens = q_lens.clamp(max=q_len)
    with on_gpu(k_cache.device):  # a layer placed apart from the pages it reads
        out = paged_attention(query.transpose(1, 2).to(k_cache.device), k_cache, v_cache, block_tables, meta.kv_lens,
                              q_pos0, q_lens, scale=scaling, sliding_window=window, validate=False,
                              sinks=None if sinks is None else sinks.to(k_cache.device))
    return out.to(query.device)


@dataclass(frozen=True)
class QueryRows:
    """Where each row's single drafter query sits, for :func:`paged_query_attention` (build once per draft
    step, reuse for every layer: the kernels' per-forward plan is keyed on these tensors)."""

    kv_lens: torch.Tensor  # [batch] int32: cached keys per row; the query sits at this position
    q_pos0: torch.Tensor  # [batch] int32: kv_lens - 1 (see paged_query_attention)
    q_lens: torch.Tensor  # [batch] int32: ones

    def to(self, device: torch.device) -> "QueryRows":
        if self.kv_lens.device == device:
            return self
        return QueryRows(self.kv_lens.to(device), self.q_pos0.to(device), self.q_lens.to(device))

    @classmethod
    def at(cls, positions: torch.Tensor) -> "QueryRows":
        positions = positions.to(torch.int32)
        return cls(positions, positions - 1, torch.ones_like(positions))


def paged_query_attention(paged_cache, layer_idx: int, query: torch.Tensor, rows: QueryRows, *,
                          scaling: float, sliding_window: int | None,
                          block_tables: torch.Tensor | None = None) -> torch.Tensor:
    """Q-only attention of a drafter over a target layer's committed pages (between forwards).

    query [batch, 1, heads, head_dim] sits at ``rows.kv_lens[b]``, one past the row's last cached token, and
    sees the last ``sliding_window`` cached keys ``kv_lens[b] - sliding_window <= j < kv_lens[b]`` (all of
    them if None). Returns [batch, 1, heads, head_dim]. ``block_tables`` replaces the cache's own tables of
    the layer's group (e.g. static ones, padded, under a CUDA graph). Over a tensor-parallel rank's pages
    (``paged_cache.head_shard``) the query heads of this rank's KV heads attend, and the ranks' outputs are
    gathered, so every rank returns all heads."""
    if block_tables is None:
        k_cache, v_cache, block_tables = paged_cache.context_pages(layer_idx)
    else:
        k_cache, v_cache = paged_cache.layer_storage(layer_idx)
    shard = paged_cache.head_shard  # tensor parallel: these pages hold this rank's KV heads only
    home, pages = query.device, k_cache.device  # a drafter placed apart from a producer: its query goes there
    query, rows = query.to(pages), rows.to(pages)
    block_tables = block_tables.to(pages)
    if shard is not None:
        query = shard.local_heads(query, dim=2)
    # The kernel's window counts the query's own position; masking as if the query sat on the last cached
    # key makes the window exactly the last `sliding_window` keys.
    with on_gpu(pages):
        out = paged_attention(query, k_cache, v_cache, block_tables, rows.kv_lens, rows.q_pos0, rows.q_lens,
                              scale=scaling, sliding_window=sliding_window, validate=False)
    return (out if shard is None else shard.gather_heads(out, dim=2)).to(home)


def _fallback(module: torch.nn.Module, sinks: torch.Tensor | None = None):
    # hf_specdec registers sdpa's boolean masks under its name, so every model falls back to sdpa
    # (eager and flash originals compute the same function, up to rounding). SDPA has no sink term: a model handing
    # over sinks runs its own module's eager function (gpt-oss's), with the boolean mask made additive.
    if sinks is None:
        return sdpa_attention_forward
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(
            f"{type(module).__name__} hands its attention learned softmax sinks, and hf_specdec finds no eager "
            "attention function of its model to run them outside its paged loop. Use the model without "
            "hf_specdec.enable()."
        )

    def eager_with_additive_mask(module, query, key, value, attention_mask, **kwargs):
        causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
        if attention_mask is None and query.shape[2] > 1 and causal:
            # sdpa's mask builder leaves out a mask that SDPA's own causal flag replaces (nothing padded, no window
            # cutting the keys): that flag's mask, whose query i sees keys 0 .. i (the prompt's queries start the
            # keys, e.g. a prefill into an empty static cache longer than the prompt)
            attention_mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                ~attention_mask, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, attention_mask, **kwargs)

    return eager_with_additive_mask


def register() -> None:
    """Register the attention function and its mask builder under ``"hf_specdec"`` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, hf_specdec_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
