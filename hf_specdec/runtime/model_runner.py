"""ModelRunner: runs an HF causal LM forward through a PagedKVCache.

The runner knows nothing about sampling or drafting: it turns "these tokens per row" into one
model forward with the right positions, slot mapping and block tables, and returns logits. It builds
the request's cache and its :class:`RequestContext`, and replays decode and verify forwards from CUDA
graphs where they apply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_specdec.cache import CacheExhaustedError, KVLayout, OutOfBlocksError, PagedKVCache, sizing
from hf_specdec.compat import cache_argument
from hf_specdec.config import CacheConfig
from hf_specdec.runtime.context import RequestContext
from hf_specdec.runtime.cuda_graphs import GraphRunner, GraphStore, HookedState, table_width_bucket
from hf_specdec.runtime.distributed import RankGroup
from hf_specdec.runtime.placement import input_device

# Keys of HF's prepared model_kwargs that the runner replaces with its own.
_RUNNER_KEYS = {
    "attention_mask", "position_ids", "logits_to_keep", "use_cache", "cache", "past_key_values", "cache_position",
    "output_attentions", "output_hidden_states", "return_dict",
}


def real_token_counts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Real tokens per row of a left-padded batch; raises on right padding or empty rows."""
    batch, length = input_ids.shape
    if attention_mask is None:
        return [length] * batch
    check_mask_shape(input_ids, attention_mask)
    mask = attention_mask.to(torch.bool)
    counts = mask.sum(dim=1)
    # Left padding means the real tokens are exactly the last `count` positions of each row.
    expected = torch.arange(length, device=mask.device)[None, :] >= (length - counts)[:, None]
    if not torch.equal(mask, expected):
        raise ValueError(
            "hf_specdec needs left-padded batches (padding before the prompt, contiguous real tokens). "
            "Set tokenizer.padding_side = 'left' before tokenizing, and pass its attention_mask (without one, "
            "transformers takes every pad_token_id in a prompt for padding, also inside it)."
        )
    counts = counts.tolist()
    if min(counts) == 0:
        raise ValueError(f"row {counts.index(0)} of the batch has no tokens; remove empty prompts.")
    return counts


def exhausted(error: OutOfBlocksError, sequences: torch.Tensor) -> CacheExhaustedError:
    """The error a request that outgrew its KV cache pool stops with, holding ``sequences`` generated so far."""
    return CacheExhaustedError(
        f"the KV cache ran out of blocks while generating ({error}); the tokens generated so far are in this "
        "error's .sequences. Raise CacheConfig.gpu_memory_fraction (CUDA) or cpu_memory_fraction (CPU), free "
        "memory, or lower the batch size or max_new_tokens.", sequences)


def check_mask_shape(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """A mask that is not the ids' [batch, sequence] shape, rejected with the fix (transformers would broadcast
    it or fail obscurely)."""
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}; "
            "pass the 2D mask the tokenizer returned with the ids (one row per prompt)."
        )


@dataclass(frozen=True)
class Select:
    """A function of a forward's ids [batch, q_len] and logits -> a tuple of tensors with the batch as first dim,
    run with the forward (:meth:`ModelRunner.forward`'s ``select``); ``name`` tells its graphs apart (one name, one
    function)."""

    name: str
    fn: Callable[[torch.Tensor, torch.Tensor], tuple]


class ModelRunner:
    """One paged forward at a time for ``model`` (an HF causal LM enabled by hf_specdec)."""

    def __init__(self, model, layout: KVLayout, cache_config: CacheConfig, graph_store: GraphStore | None = None,
                 ranks: RankGroup | None = None, head_shard: RankGroup | None = None):
        """``graph_store``: the model's store of CUDA graphs and pooled K/V storage, or None for eager forwards.
        ``ranks``: the tensor-parallel group ``model`` is sharded over; ``head_shard``: the same group when it splits
        the KV heads (``layout`` then holds this rank's share)."""
        self.model, self.layout, self.cache_config, self.graph_store = model, layout, cache_config, graph_store
        self.ranks, self.head_shard = ranks, head_shard
        self.cache: PagedKVCache | None = None
        self.context: RequestContext | None = None
        self.graphs: GraphRunner | None = None
        self.hooked = HookedState(None)
        self._mask_stub: torch.Tensor | None = None
        self._cache_argument = cache_argument(model.forward)
        # a MoE config asking for router logits would have the forward compute its load-balancing loss against the
        # mask stub (a training aid: generate returns no router logits)
        self._flags = {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}

    def start(self, prompt_lens: list[int], max_new_tokens: int, lookahead: int = 0,
              draft_model: torch.nn.Module | None = None, window_slack: int = 0,
              draft_modules: list[torch.nn.Module] = ()) -> RequestContext:
        """Build the request's cache (raises ``CacheCapacityError`` before anything runs when it does not fit)
        and its context. ``draft_model``: the model whose attention writes a drafter's own caches, if any.
        ``window_slack``: positions sliding windows keep besides their own (``PagedKVCache.widen_windows``).
        ``draft_modules``: other modules whose weights the drafter's graphs read."""
        dtype = self.model.get_input_embeddings().weight.dtype
        device = input_device(self.model)  # model.device is the meta device when the first weight is on disk
        store = self.graph_store if self.graph_store is not None and device.type == "cuda" else None
        if store is not None:
            store.check_weights(self.model, *([] if draft_model is None else [draft_model]), *draft_modules)
        shared_budget = None if self.ranks is None else self.ranks.smallest
        self.cache = sizing.cache_for_request(self.layout, self.cache_config, prompt_lens, max_new_tokens, lookahead,
                                              dtype=dtype, device=device, storage_pool=store,
                                              shared_budget=shared_budget)
        self.cache.head_shard = self.head_shard
        if window_slack:
            self.cache.widen_windows(window_slack)
        self.context = RequestContext(self.cache, self.cache_config, list(prompt_lens), max_new_tokens, lookahead,
                                      ranks=self.ranks, draft_model=draft_model)
        # A 4D mask is passed through transformers' mask builders untouched; the paged attention ignores it.
        self._mask_stub = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        if store is not None:
            # the widest block table any row can reach in this request, bucketed so later requests share graphs
            width = table_width_bucket(
                -(-(max(prompt_lens) + max_new_tokens + lookahead) // self.cache_config.block_size) + 1)
            self.graphs = GraphRunner(self.model, store, self.cache, width, self.hooked)
            self.context.graph_store, self.context.graph_table_width = store, width  # drafters capture theirs too
        return self.context

    def record_hooks_of(self, holder, signature=None) -> None:
        """``holder`` (an object or a list) is where a drafter's forward hooks put what they record, and
        ``signature`` says which hooks those are; graph replays keep the holder current."""
        self.hooked.holder = holder
        self.hooked.signature = signature

    def finish(self) -> None:
        self.graphs = None
        if self.cache is not None:
            self.cache.free()
        self.cache = self.context = None

    def forward(self, input_ids: torch.Tensor, num_new: list[int], keep_logits: int = 0, *, prefill: bool = False,
                starts: torch.Tensor | None = None, select: Select | None = None, **model_kwargs):
        """Run ``input_ids`` [batch, q_len] (right-aligned real tokens, ``num_new[b]`` per row) through the
        model, with logits of the last ``keep_logits`` slots (0: all); the tokens stay in the cache until
        :meth:`commit` says otherwise. ``model_kwargs`` not owned by the runner (e.g. pixel inputs) pass through.
        A ``prefill`` runs eagerly whatever its width (it runs once per request: a graph would not be replayed).

        ``starts`` [batch] int32 on the cache's device: every row's tokens sit at positions ``starts[b] ..`` that
        only the device knows (``num_new`` is then the width for every row; ``PagedKVCache.plan_at``).

        Decode and verify forwards replay a CUDA graph of the batch's bucket from their second step on (see
        cuda_graphs); the logits they return live in the graph's memory until the next forward.

        ``select``: what the caller computes from the forward's ids and logits next (greedy tokens, greedy
        acceptance), on the device without a host sync: it runs right after the forward, inside the graph where one
        replays (no launches of its own from the host), and its tensors are the outputs' ``selected``."""
        if starts is None:
            plan = self.cache.plan_forward(num_new, input_ids.shape[1])
        else:
            plan = self.cache.plan_at(starts, input_ids.shape[1])
        extra = {k: v for k, v in model_kwargs.items() if k not in _RUNNER_KEYS}
        if prefill:
            return self._checked_prefill(input_ids, plan, keep_logits, extra, select)
        if self.graphs is None or not self.graphs.can_run(input_ids, extra):
            return self._eager(input_ids, plan, keep_logits, extra, select)
        key = self.graphs.key(input_ids, keep_logits, select)
        if self.graphs.has(key):
            out, meta = self.graphs.replay(key, input_ids, plan)
            self.cache.meta = self.context.forward_meta = meta  # the real rows of the graph's static metadata
            return out
        out = self._eager(input_ids, plan, keep_logits, extra, select)
        self.graphs.capture(key, input_ids, plan,
                            lambda ids: self._forward(ids, self.cache.meta.position_ids, keep_logits, {}, select))
        return out

    def _checked_prefill(self, input_ids, plan, keep_logits, extra, select):
        """A request's first forward, checking that every layer that stored K/V attended through the pages: a model
        whose layer does not hand the cache's forward to its attention (it drops the attention's kwargs) or that
        stores under other layer indices than it reads would otherwise decode silently wrong."""
        self.cache.layers_seen = (set(), set())
        try:
            out = self._eager(input_ids, plan, keep_logits, extra, select)
            stored, attended = self.cache.layers_seen
        finally:
            self.cache.layers_seen = None
        missed = sorted(stored - attended)
        if missed:
            raise ValueError(
                f"{type(self.model).__name__}: layers {missed} stored K/V in hf_specdec's paged cache but their attention "
                "did not read it (the layer does not pass the attention's keyword arguments on, or reads under another "
                "layer index), so it would decode wrongly. Use the model without hf_specdec.enable()."
            )
        return out

    def _eager(self, input_ids, plan, keep_logits, extra, select=None):
        meta = self.context.forward_meta = self.cache.begin(plan)
        return self._forward(input_ids, meta.position_ids, keep_logits, extra, select)

    def _forward(self, input_ids, position_ids, keep_logits, extra, select=None):
        out = self.model(
            input_ids=input_ids, position_ids=position_ids,
            attention_mask=self._mask_stub.expand(input_ids.shape[0], -1, -1, -1),  # a graph's rows: its bucket
            paged_cache=self.cache, use_cache=True, logits_to_keep=keep_logits, return_dict=True,
            **{self._cache_argument: self.cache}, **self._flags, **extra,
        )
        if select is not None:
            out.selected = tuple(select.fn(input_ids, out.logits))
        return out

    def commit(self, new_lens: list[int], in_flight: bool = False) -> None:
        """Keep ``new_lens[b]`` tokens of each row (the rest is rolled back). ``in_flight``: a later forward is
        queued already (its tokens among the ones kept): the context keeps that forward's metadata, and the caller
        sets ``context.committed_lens``."""
        self.cache.commit(new_lens)
        if not in_flight:
            self.context.forward_meta = None
            self.context.committed_lens = list(new_lens)
