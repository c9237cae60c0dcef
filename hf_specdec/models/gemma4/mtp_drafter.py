"""Gemma 4 MTP drafting on the target's pages: the Drafter the speculative loop drives for spec_mode="mtp".

Per round, with p the position of each row's last committed token (not yet seen by the target):

    step 0:  token at p, the target's final-normed hidden state at p-1   -> draft 1, hidden_1
    step j:  draft j, hidden_j (post_projection output)                  -> draft j+1
    every step queries at p and reads the producer layers' pages of the accepted context only
    (positions < p; the rejected drafts' K/V sit past each row's length and are never visible).

After verify, the next round's hidden is the verify forward's hidden at the row's last accepted position.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass

import torch

from hf_specdec.attention import QueryRows, paged_query_attention
from hf_specdec.generation.drafter import Drafter, DraftProposal, DraftsInVerify, take_rows
from hf_specdec.generation.fusion import fuse_drafter, gpu_of_weights, stack_projections
from hf_specdec.kernels import use_triton
from hf_specdec.kernels.argmax import argmax
from hf_specdec.kernels.stacked_linear import stack_weights
from hf_specdec.models.gemma4.assistant import Gemma4MTPAssistant, fused_embedding_scale, target_embedding
from hf_specdec.models.gemma4.assistant_config import check_compatible, producer_layer_for, target_text_config
from hf_specdec.runtime.cuda_graphs import pad_table
from hf_specdec.runtime.placement import input_device, layer_devices, place_drafter

DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# the most drafts a num_speculative_tokens="auto" round may have: k=7 was the best fixed k at batch 1 on the 31B shape
# (docs/perf_log.md, session 17); the controller settles lower where a round's measured cost says so
AUTO_K_MAX = 7


@dataclass
class _Captured:
    hidden: torch.Tensor | None = None  # [batch, q_len, hidden] final-normed states of the last target forward


class PagedTargetKVSource:
    """``TargetKVSource`` over the target's paged cache: each assistant layer reads its producer's pages."""

    def __init__(self, cache, producers: dict[str, int], draft_positions: torch.Tensor,
                 tables: dict[int, torch.Tensor] | None = None):
        self.cache = cache
        self.producers = producers
        self.rows = QueryRows.at(draft_positions)  # [batch]: the draft position = the number of cached keys
        self.tables = tables or {}  # per producer layer: block tables to use instead of the cache's (graphs)

    def attend(self, layer_type, query, *, scaling, sliding_window):
        layer = self.producers[layer_type]
        return paged_query_attention(self.cache, layer, query, self.rows, scaling=scaling,
                                     sliding_window=sliding_window, block_tables=self.tables.get(layer))


class Gemma4MTPDraftRunner(Drafter):
    """Drives a :class:`Gemma4MTPAssistant` for the speculative loop (spec_mode="mtp")."""

    spec_mode = "mtp"
    adaptive_k = True  # each round runs num_speculative_tokens draft steps (greedy graphs are kept per k)
    drops_rows = True  # its per-row state is the next round's hidden state (it reads the target's cache)
    runs_ahead = True  # greedy drafts ahead come from the verify's hidden states and metadata (device tensors)

    def __init__(self, target, assistant: Gemma4MTPAssistant, num_speculative_tokens: int | None = None):
        check_compatible(assistant, target)
        self.target = target
        text_config = target_text_config(target)
        self.producers = {t: producer_layer_for(text_config, t) for t in set(assistant.config.text_config.layer_types)}
        # beside the producer layers whose pages it reads (the last of them if accelerate split them)
        home = input_device(target)
        self.assistant = fuse_drafter(place_drafter(assistant, layer_devices(target).get(max(self.producers.values()))
                                                    or home, home=home))
        with gpu_of_weights(self.assistant):  # whether the kernels run where its weights are
            stack_assistant_weights(self.assistant)
        self.num_speculative_tokens = num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS
        self.embed = target_embedding(target)
        self.embed_scale = fused_embedding_scale(self.embed, self.assistant.pre_projection.weight.dtype)
        self.layers = sorted(set(self.producers.values()))  # the producer layers whose pages the drafts read
        # a draft graph's inputs are tokens, hidden states, positions, then a block table per producer layer;
        # padding rows draft token 0 at position 0 over no pages: they only read, and their drafts are dropped
        self.pad_values = (0, 0, 0) + (-1,) * len(self.layers)
        self.hidden: torch.Tensor | None = None  # [batch, backbone_hidden] for the next round's step 0

    @property
    def device(self) -> torch.device:
        """Where the assistant runs (runtime/placement.py)."""
        return self.assistant.pre_projection.weight.device

    @contextlib.contextmanager
    def capture(self, target):
        """Record the final-normed hidden states (what lm_head reads) of every target forward."""
        captured = _Captured()
        norm = _final_norm(target)
        handle = norm.register_forward_hook(lambda module, args, out: setattr(captured, "hidden", out))
        try:
            yield captured
        finally:
            handle.remove()

    def begin(self, context, captured):
        self.hidden = captured.hidden[:, -1].to(self.device)  # the last slot is each row's last prompt token
        self.graphs = context.drafter_graphs("gemma4_mtp", id(self.assistant), id(self.embed))
        # rounds whose next hidden states were taken ahead of their commit (propose_ahead, or drafts_in_verify's take,
        # which comes before the commit of the round before it): their commits take nothing
        self._taken = 0

    @torch.inference_mode()
    def propose(self, last_tokens, context, selector) -> DraftProposal:
        cache = context.cache
        positions = torch.tensor(cache.seq_lens, device=self.device)
        if not selector.do_sample and not selector.scorer.processors:
            return DraftProposal(self._greedy(last_tokens, positions, cache).to(last_tokens.device), None)
        # sampling or logits processors: each step's forward (one graph replay on CUDA), then the selection
        # (processors are arbitrary host code, and q is needed per step)
        tables = self._tables(cache)
        tokens, hidden, drafted, probs = last_tokens, self.hidden, last_tokens[:, None][:, :0], []
        for _ in range(self.num_speculative_tokens):
            hidden, head = self.graphs.run("step", functools.partial(self._one_step, cache),
                                           [tokens, hidden, positions, *tables], pad_values=self.pad_values)
            head = head.to(drafted.device) if isinstance(head, torch.Tensor) else head  # device_map: the loop's
            tokens, q = selector.select(head, drafted)
            drafted = torch.cat([drafted, tokens[:, None]], dim=1)
            probs.append(q)
        return DraftProposal(drafted, None if probs[0] is None else torch.stack(probs, dim=1))

    def _tables(self, cache) -> list[torch.Tensor]:
        """The producer layers' block tables between forwards, padded to the graphs' width when graphs are on
        (-1 columns: no page), once for the round's k steps."""
        tables = [cache.context_pages(layer)[2] for layer in self.layers]
        return [pad_table(t, self.graphs.table_width) for t in tables] if self.graphs.on else tables

    def _one_step(self, cache, tokens, hidden, positions, *tables):
        """One draft step -> (hidden_next, head)."""
        kv_source = PagedTargetKVSource(cache, self.producers, positions, dict(zip(self.layers, tables)))
        step = self.assistant.draft_step(tokens, hidden, positions, self.embed, kv_source,
                                         self.assistant.draft_rope(positions), self.embed_scale)
        return step.hidden_next, step.logits

    @torch.inference_mode()
    def propose_ahead(self, next_tokens, num_accepted, context, captured, selector) -> DraftProposal | None:
        """Greedy drafts of the next round before the cache commits: a row that keeps running commits
        ``num_accepted + 1`` tokens, so it drafts at ``p + num_accepted + 1`` from the verify's hidden state at
        its last accepted slot, over pages the verify already holds (the Q-only attention reads positions below
        the draft position only). Sampling and logits processors draft after the commit (``propose``)."""
        if selector.do_sample or selector.scorer.processors or context.forward_meta is None:
            return None
        self._take_hidden(captured, num_accepted)
        self._taken += 1
        positions = _draft_positions(context.forward_meta, num_accepted)
        drafts = self._greedy(next_tokens, positions.to(self.device), context.cache)
        return DraftProposal(drafts.to(next_tokens.device), None)

    def drafts_in_verify(self, context, captured) -> DraftsInVerify | None:
        """The greedy drafts of :meth:`propose_ahead` from inside the verify: its final-normed hidden state at each
        row's last accepted slot, its metadata's first positions and the producer groups' block tables (the
        verify's own, which hold every page the drafts read: positions below the draft position)."""
        cache = context.cache
        if any(k.device != self.device for k in cache.k_storage):
            return None  # pages on several devices, or apart from the drafter: propose_ahead moves what it reads
        return DraftsInVerify(("gemma4_mtp", id(self.assistant), id(self.embed), self.num_speculative_tokens),
                              functools.partial(self._drafts_in_verify, cache, captured), self._take_in_verify)

    def _groups(self, cache) -> list[int]:
        return [cache.layout.layer_slot[layer][0] for layer in self.layers]

    def _drafts_in_verify(self, cache, captured, next_tokens, num_accepted):
        hidden = _at_last_accepted(captured.hidden, num_accepted)
        tables = [cache.meta.block_tables[g] for g in self._groups(cache)]
        return self._greedy_drafts(cache, next_tokens, hidden, _draft_positions(cache.meta, num_accepted),
                                   *tables), hidden

    def _take_in_verify(self, hidden) -> None:
        self.hidden = hidden
        self._taken += 1

    def _greedy(self, last_tokens, positions, cache) -> torch.Tensor:
        """Greedy drafts [batch, k] of all k steps: on CUDA one graph replay, kept for later requests of the same
        batch bucket and k."""
        return self.graphs.run("greedy", functools.partial(self._greedy_drafts, cache),
                               [last_tokens, self.hidden, positions, *self._tables(cache)], pad_values=self.pad_values,
                               key=(self.num_speculative_tokens,))

    def _greedy_drafts(self, cache, tokens, hidden, positions, *tables) -> torch.Tensor:
        kv_source = PagedTargetKVSource(cache, self.producers, positions, dict(zip(self.layers, tables)))
        drafted = []
        rope = self.assistant.draft_rope(positions)
        for _ in range(self.num_speculative_tokens):
            step = self.assistant.draft_step(tokens, hidden, positions, self.embed, kv_source, rope, self.embed_scale)
            head = step.logits
            tokens = argmax(head) if isinstance(head, torch.Tensor) else head.argmax()
            drafted.append(tokens)
            hidden = step.hidden_next
        return torch.stack(drafted, dim=1)

    def commit(self, context, captured, num_accepted, kept):
        if self._taken:  # propose_ahead or drafts_in_verify took them already (and drafted from them)
            self._taken -= 1
        else:
            self._take_hidden(captured, num_accepted)

    def keep_rows(self, rows):
        self.hidden = take_rows(self.hidden, rows)

    def _take_hidden(self, captured, num_accepted) -> None:
        """The next round's hidden state: the verify's final-normed state at each row's last accepted slot."""
        self.hidden = _at_last_accepted(captured.hidden, num_accepted).to(self.device)


def _at_last_accepted(hidden: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """A verify's states [batch, k+1, hidden] at each row's last accepted slot -> [batch, hidden]."""
    index = num_accepted.to(device=hidden.device, dtype=torch.int64)[:, None, None].expand(-1, 1, hidden.shape[-1])
    return hidden.gather(1, index).squeeze(1)


def _draft_positions(meta, num_accepted: torch.Tensor) -> torch.Tensor:
    """[batch] int64: where each row's next drafts sit, past its accepted tokens (the verify's first query position
    is the row's committed length before it, stopped rows included). A graph's padding rows, whose first position is
    below 0, draft at 0 over no pages, and are dropped."""
    first = meta.q_pos0.to(torch.int64)
    return (first + num_accepted.to(device=first.device, dtype=torch.int64) + 1).clamp(min=0)


_STACKED: "weakref.WeakKeyDictionary[Gemma4MTPAssistant, tuple]" = weakref.WeakKeyDictionary()


def stack_assistant_weights(assistant: Gemma4MTPAssistant) -> None:
    """Where the kernels run, gate/up of every assistant block as one GEMM, and post_projection with the centroid
    scores as another (stacked storage, same parameters and values). Done once per assistant: again only after
    its weights were moved, cast or replaced."""
    if _STACKED.get(assistant) == _weights_signature(assistant):
        return
    for module in assistant.modules():
        stack_projections(module)
    head = assistant.masked_embedding
    if head is not None and use_triton(head.centroids.weight):
        stack_weights(assistant.post_projection, head.centroids)
    _STACKED[assistant] = _weights_signature(assistant)


def _weights_signature(assistant: Gemma4MTPAssistant) -> tuple:
    """Where the assistant's weights are (and whether the kernels run there): stacking changes the pointers."""
    params = list(assistant.parameters())
    return (bool(params) and use_triton(params[0]), *((p.data_ptr(), p.dtype) for p in params))


def _final_norm(target) -> torch.nn.Module:
    """The final RMSNorm of a Gemma 4 text decoder, for Gemma4ForCausalLM and Gemma4ForConditionalGeneration."""
    model = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    language_model = getattr(model, "language_model", model)
    return language_model.norm


def matches(target, assistant) -> bool:
    return isinstance(assistant, Gemma4MTPAssistant)


def build(target, assistant, num_speculative_tokens):
    return Gemma4MTPDraftRunner(target, assistant, num_speculative_tokens)
