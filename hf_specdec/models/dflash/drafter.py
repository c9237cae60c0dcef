"""DFlash drafting over a paged context cache: the draft runner the speculative loop drives for spec_mode="dflash".

Per round, with p the number of tokens the target has cached for a row (its last committed token t[p] is
not in the target's cache yet):

    context  draft layer l's K/V of positions 0 .. p-1 -- rope(k_norm(k_proj_l(f))), v_proj_l(f) of the fused
             feature f = hidden_norm(fc(cat[target hidden after each target_layer_id])) of every accepted
             token -- in the drafter's own PagedKVCache (layers alike share a KV group; each its own pages);
    block    [t[p], mask x k] at positions p .. p+k, one drafter forward: each layer stores the block's K/V
             past the row's length, attends over [context, block] pages (bidirectional within the block for
             full layers, causal for sliding ones), and the block is dropped again afterwards (the row's
             length never moves), so between forwards the cache holds accepted tokens only;
    drafts   the target's head (with its final soft-cap) at block positions 1..k, one token per position
             through the loop's DraftSelector (so sampling gives q).

The context grows in `begin` (the prompt) and `commit` (the `kept` tokens of each row's verify forward,
whose hidden states were captured by hooks during that same forward): rejected drafts never reach it, so
the drafter's lengths always equal the target's.

Greedy drafting runs ahead (`propose_ahead`): right after the acceptance, before the round's host sync, the
context append takes all k+1 verified positions p .. p+k (K/V of the rejected ones sit past the row's new
length, as the target's do) and the next block forward runs at p' = p + accepted + 1, a position only the
device knows: its metadata is derived from device counts over block tables the host reserved for the longest
case. The host's commit then only sets the lengths. The device drafts while the host emits and commits.

With CUDA graphs on, the block forward (greedy: with its drafts' argmax; sampled: up to the logits, selected
eagerly) and each commit's context append run as graphs of the batch's bucket (kept in the target's GraphStore,
over the drafter's pooled cache storage): their inputs are the token or hidden-state tensors and the whole forward
metadata, padding rows have no query, no key, no slot and no page.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from hf_specdec.cache import ForwardMeta, KVLayout, PagedKVCache
from hf_specdec.generation.drafter import Drafter, DraftProposal
from hf_specdec.generation.fusion import fuse_drafter, gpu_of_weights
from hf_specdec.kernels import paged_attention, store_kv
from hf_specdec.kernels.argmax import argmax
from hf_specdec.kernels.store_kv import store_kv_layers
from hf_specdec.runtime.placement import execution_device, input_device, loaded_weights, place_drafter

from .configuration import is_dflash_checkpoint
from .modeling import DFlashDrafter
from .target import capture_hidden_states, check_compatible


class PagedDFlashContext:
    """`DFlashContextSource` over the drafter's paged cache during one block forward (`meta`: the block's slots).

    Each layer writes its block K/V into the block's slots (past the row's committed length) and attends over
    the row's pages up to the block's end; the kernel's rule is the DFlash rule (`context.py`): context key c is
    visible from block query j iff (p + j) - c < window, block key i iff not causal or i <= j."""

    def __init__(self, cache: PagedKVCache, meta: ForwardMeta):
        self.cache = cache
        self.meta = meta

    def attend(self, layer_idx, query, block_k, block_v, *, scaling, causal_block, sliding_window):
        k_cache, v_cache, block_tables, _ = self.cache.layer_pages(layer_idx)
        group = self.cache.layout.layer_slot[layer_idx][0]
        batch, block_len, kv_heads, head_dim = block_k.shape
        # the metadata is the cache's own: no argument checks (as the target's attention)
        store_kv(block_k.reshape(batch * block_len, kv_heads, head_dim),
                 block_v.reshape(batch * block_len, kv_heads, head_dim), k_cache, v_cache,
                 self.meta.slot_mapping[group], validate=False)
        return paged_attention(query, k_cache, v_cache, block_tables, self.meta.kv_lens, self.meta.q_pos0,
                               self.meta.q_lens, scale=scaling, sliding_window=sliding_window, causal=causal_block,
                               validate=False)


def context_layout(drafter: DFlashDrafter) -> KVLayout:
    """The draft layers' context K/V, one KV group per distinct (kv heads, head_dim, sliding window): layers alike
    share one block table per row, so a forward allocates, plans and (on CPU) builds its attention gather once for
    all of them rather than once per layer. Every layer owns its pages (no layer reads another's)."""
    specs = drafter.layer_specs
    return KVLayout.from_layers([(s.num_kv_heads, s.head_dim, s.sliding_window) for s in specs],
                                {s.layer_idx: s.layer_idx for s in specs})


class DFlashDraftRunner(Drafter):
    """Drives a :class:`DFlashDrafter` for the speculative loop (spec_mode="dflash")."""

    spec_mode = "dflash"
    adaptive_k = True  # a round's block is [last token, mask x num_speculative_tokens] (graphs kept per width)
    drops_rows = True  # its per-row state is its context cache
    runs_ahead = True  # greedy drafts ahead append the verify's context at the committed lengths, then the block

    def draft_cost(self, k: int) -> float:
        """One block forward whatever k (docs/perf_log.md: ~0.16 of a 31B target step)."""
        return 0.15 + 0.005 * k

    def __init__(self, target, drafter: DFlashDrafter, num_speculative_tokens: int | None = None):
        check_compatible(drafter, target)
        self.num_speculative_tokens = _check_num_speculative_tokens(drafter, num_speculative_tokens)
        self.target = target
        # beside the target's LM head, which turns its hidden states into logits (runtime/placement.py)
        home = input_device(target)
        self.drafter = fuse_drafter(place_drafter(drafter, execution_device(target.get_output_embeddings()) or home,
                                                  home=home))
        with gpu_of_weights(self.drafter):  # whether the kernels run where its weights are
            self.drafter.stack_projections()
        self.layout = context_layout(drafter)
        self.cache: PagedKVCache | None = None

    @property
    def capture_key(self) -> tuple:
        """The target layers the capture hooks record: target graphs captured with other hooks (another
        drafter's layers) must not be replayed for this one."""
        return ("target_layer_ids", *self.drafter.target_layer_ids)

    @contextlib.contextmanager
    def capture(self, target):
        """Record the hidden states after the drafter's target layers during every target forward."""
        with capture_hidden_states(target, self.drafter.target_layer_ids) as captured, _every_position(
                target, self.drafter.target_layer_ids):
            try:
                yield captured
            finally:
                if self.cache is not None:
                    self.cache.free()
                self.cache = None

    def begin(self, context, captured):
        self.graphs = context.drafter_graphs("dflash", id(self.drafter), id(self.target), self.num_speculative_tokens)
        # room past a row's length for a verify's k + 1 positions and, drafting ahead, the next block's k + 1
        self.cache = context.new_cache(self.layout, "dflash", dtype=self.drafter.fc.weight.dtype,
                                       lookahead=2 * (self.num_speculative_tokens + 1),
                                       device=self.drafter.fc.weight.device)
        self._ahead = False  # propose_ahead appended the last verify's context already
        # prefill slots are right-aligned already; a prompt's width varies per request: no graph
        self._append_context([h.to(self.drafter.fc.weight.device) for h in captured], context.prompt_lens, graph=False)

    @torch.inference_mode()
    def propose(self, last_tokens, context, selector) -> DraftProposal:
        k = self.num_speculative_tokens
        lens = self.cache.seq_lens
        plan = self.cache.plan_forward([k + 1] * len(lens), k + 1)  # block positions p .. p + k
        try:
            if not selector.do_sample and not selector.scorer.processors:  # greedy: the argmax of every position
                drafts = self.graphs.run("block", self._greedy_block, [last_tokens], plan=plan, cache=self.cache)
                return DraftProposal(drafts.to(last_tokens.device), None)
            # sampling or logits processors: the block forward (a graph replay on CUDA), then the selection on
            # its logits [batch, k, vocab] (processors are host code); a graph's logits are its static buffer,
            # read before the next replay
            logits = self.graphs.run("block_logits", self._block_logits, [last_tokens], plan=plan, cache=self.cache)
        finally:
            self.cache.commit(lens)  # drop the block: the context keeps accepted tokens only
        return DraftProposal(*selector.select_block(logits.to(last_tokens.device)))

    @torch.inference_mode()
    def propose_ahead(self, next_tokens, num_accepted, context, captured, selector) -> DraftProposal | None:
        """Greedy drafts of the next round before the caches commit: the context append of every verified
        position, then the block at each row's next position (``p + num_accepted + 1``, on the device), over blocks
        reserved for the longest case; None (``propose`` after the commit) when sampling, with logits processors,
        or when those blocks do not fit the pool or the graphs' block tables."""
        if selector.do_sample or selector.scorer.processors:
            return None
        verified, k = captured[0].shape[1], self.num_speculative_tokens
        if verified != k + 1:
            # k changed this round ("auto"): the verify checked drafts of the old k. One graph per (old, new) pair
            # would be captured at each new pair, inside whatever call first switches that way; the commit's
            # context append and the block after it run on graphs per k instead
            return None
        lens = self.cache.seq_lens
        if not self.graphs.can_reserve(self.cache, verified + k + 1):
            return None  # (the commit's own append reports a pool that is really exhausted)
        device = self.drafter.fc.weight.device
        hidden = [h.to(device) for h in captured]
        context_plan = self.cache.plan_forward([verified] * len(lens), verified)  # positions p .. p + k_round
        start = context_plan.counts[0] + num_accepted.to(device=device, dtype=torch.int32) + 1
        block_plan = self.cache.plan_at(start, k + 1)  # room for the longest block
        # the context append and the block in one call (one graph replay on CUDA)
        drafts = self.graphs.run("ahead", self._context_then_block, [next_tokens, *hidden],
                                 plans=[context_plan, block_plan])
        self._ahead = True
        return DraftProposal(drafts.to(next_tokens.device), None)

    def _context_then_block(self, last_tokens, *hidden_and_metas) -> torch.Tensor:
        """The context append of a verify's hidden states, then the greedy block after it (``propose_ahead``)."""
        *hidden, context_meta, block_meta = hidden_and_metas
        with self.cache.forward_with(context_meta):
            self._store_context(*hidden, context_meta)
        with self.cache.forward_with(block_meta):
            return self._greedy_block(last_tokens, block_meta)

    def _block_logits(self, last_tokens, meta, greedy: bool = False) -> torch.Tensor:
        """The drafts' logits [batch, k, vocab] of one block forward (its K/V stored in the block's slots); with
        ``greedy``, logits of the same argmax (:meth:`DFlashDrafter.greedy_logits`)."""
        ids = self.drafter.block_input_ids(last_tokens, self.num_speculative_tokens)
        with loaded_weights(self.target.get_input_embeddings()):  # an offloaded table is read directly
            embeds = self.drafter.embed_block(self.target, ids).to(meta.position_ids.device)
        hidden = self.drafter(embeds, meta.position_ids, PagedDFlashContext(self.cache, meta))
        if greedy:
            return self.drafter.greedy_logits(self.target, hidden)
        return self.drafter.draft_logits(self.target, hidden)

    def _greedy_block(self, last_tokens, meta) -> torch.Tensor:
        return argmax(self._block_logits(last_tokens, meta, greedy=True))  # [batch, k]

    def commit(self, context, captured, num_accepted, kept):
        if self._ahead:  # propose_ahead stored every verified position: keep the target's committed tokens
            self._ahead = False
            self.cache.commit(context.committed_lens)
            return
        # the verify forward's first kept[b] slots are row b's accepted tokens; right-align them as a forward's
        q_len = captured[0].shape[1]
        shift = torch.tensor([q_len - n for n in kept], device=captured[0].device)
        index = (torch.arange(q_len, device=shift.device)[None, :] - shift[:, None]).clamp(min=0)
        device = self.drafter.fc.weight.device  # the target layers it reads may run elsewhere (device_map)
        aligned = [h.gather(1, index[:, :, None].expand(-1, -1, h.shape[-1]).to(h.device)).to(device)
                   for h in captured]
        self._append_context(aligned, kept)
        if self.cache.seq_lens != context.committed_lens:
            raise RuntimeError(f"DFlash context lengths {self.cache.seq_lens} drifted from the target's "
                               f"{context.committed_lens}; commit must follow the target cache's commit.")

    def _one_group(self) -> int | None:
        return _layers_group(self.layout, len(self.drafter.layers))

    def keep_rows(self, rows):
        self.cache.keep_rows(rows)

    @torch.inference_mode()
    def _append_context(self, hidden: list[torch.Tensor], num_new: list[int], graph: bool = True) -> None:
        """Append the context K/V of the last num_new[b] slots of `hidden` (one [batch, q_len, target_hidden]
        per target layer id) to every draft layer's group."""
        plan = self.cache.plan_forward(num_new, hidden[0].shape[1])
        if graph:
            self.graphs.run("context", self._store_context, hidden, plan=plan, cache=self.cache)
        else:
            self._store_context(*hidden, self.cache.begin(plan))
        self.cache.commit(self.cache.seq_lens)  # the plan grew the lengths; keep every new token

    def _store_context(self, *hidden_and_meta) -> None:
        *hidden, meta = hidden_and_meta
        positions, slots = meta.position_ids, meta.slot_mapping
        eager = hidden[0].device.type == "cpu"
        if eager:  # the kept tokens only (a verify's rejected drafts have no slot: their K/V would be dropped)
            kept = torch.stack([s >= 0 for s in slots]).any(0).nonzero().squeeze(1)  # a slot in some group
            hidden = [h.flatten(0, 1).index_select(0, kept)[None] for h in hidden]
            positions = positions.flatten().index_select(0, kept)[None]
            slots = [s.index_select(0, kept) for s in slots]
        features = self.drafter.context_features(hidden)
        layers = self.drafter.context_kv_all_layers(features, positions)
        group = self._one_group()
        if eager and group is not None:  # the layers' pages are slices of one storage: one write for all
            store_kv_layers(torch.stack([k.flatten(0, 1) for k, _ in layers]),
                            torch.stack([v.flatten(0, 1) for _, v in layers]),
                            self.cache.k_storage[group], self.cache.v_storage[group], slots[group])
            return
        for layer_idx, (keys, values) in enumerate(layers):
            k_cache, v_cache = self.cache.layer_storage(layer_idx)
            store_kv(keys.flatten(0, 1), values.flatten(0, 1), k_cache, v_cache,
                     slots[self.layout.layer_slot[layer_idx][0]], validate=False)


def _layers_group(layout: KVLayout, layers: int) -> int | None:
    """The KV group whose storage holds draft layers 0 .. layers-1 in order (its slot i: layer i), or None."""
    slots = [layout.layer_slot[i] for i in range(layers)]
    group = slots[0][0]
    if slots != [(group, i) for i in range(layers)] or len(layout.groups[group].layers) != layers:
        return None
    return group


def _check_num_speculative_tokens(drafter: DFlashDrafter, requested: int | None) -> int:
    """k: block_size - 1 unless asked; at most block_size - 1 (the block is [last token, mask x k])."""
    limit = drafter.block_size - 1
    k = limit if requested is None else requested
    if not 1 <= k <= limit:
        raise ValueError(f"num_speculative_tokens={k} but this DFlash drafter drafts blocks of block_size="
                         f"{drafter.block_size}: pass num_speculative_tokens <= {limit} (or leave it out for {limit}).")
    for spec in drafter.layer_specs:
        # the kernel bounds a bidirectional window from below only, exact while the block fits in the window
        if not spec.causal_block and spec.sliding_window is not None and k + 1 > spec.sliding_window:
            raise ValueError(f"num_speculative_tokens={k} makes blocks of {k + 1} tokens, wider than the sliding "
                             f"window ({spec.sliding_window}) of bidirectional draft layer {spec.layer_idx}; pass "
                             f"num_speculative_tokens <= {spec.sliding_window - 1}.")
    return k


@contextlib.contextmanager
def _every_position(target, layer_ids):
    """Gemma 4 with KV-shared layers computes only the kept positions in those layers for an integer
    `logits_to_keep` (the runner's prefill asks for 1; transformers versions whose text model takes the argument):
    while open, hand its text model the equivalent index tensor instead, so hooks on those layers still see every
    position. The LM head keeps slicing with the integer: an index tensor there would have to be on the device of
    the final norm, and accelerate moves a model's tensor arguments to a device of its choosing."""
    text = target.config.get_text_config()
    first_shared = text.num_hidden_layers - (getattr(text, "num_kv_shared_layers", 0) or 0)
    decoder = target.get_decoder() if max(layer_ids) >= first_shared else None
    if decoder is None or "logits_to_keep" not in inspect.signature(decoder.forward).parameters:
        yield
        return

    def keep_as_index(module, args, kwargs):
        keep = kwargs.get("logits_to_keep")
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if isinstance(keep, int) and keep > 0 and ids is not None:  # a multimodal model hands its text model embeds
            width = ids.shape[1]
            kwargs["logits_to_keep"] = torch.arange(max(width - keep, 0), width, device=ids.device)
        return args, kwargs

    handle = decoder.register_forward_pre_hook(keep_as_index, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def matches(target, assistant) -> bool:
    return isinstance(assistant, DFlashDrafter)


def misloaded(assistant) -> str | None:
    """What is wrong where ``assistant`` is a DFlash checkpoint that transformers' Auto class built as its base model
    type (a Qwen3 causal LM, without the drafter's layers), else None."""
    config = getattr(assistant, "config", None)
    if isinstance(assistant, DFlashDrafter) or config is None or not is_dflash_checkpoint(config.to_dict()):
        return None
    return ("was loaded from a DFlash drafter checkpoint as a plain causal LM, which leaves out its drafter layers: "
            "load it with hf_specdec.AutoModelForCausalLM.from_pretrained(path) (or DFlashDrafter.from_pretrained).")


def build(target, assistant, num_speculative_tokens):
    return DFlashDraftRunner(target, assistant, num_speculative_tokens)
