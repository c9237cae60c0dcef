"""Step 3.5 drafting with its own MTP layers: the draft runner the loop drives for ``step_model.generate(spec_mode="mtp")``.

Draft step j uses MTP layer j and its own head. MTP layer j is a sequence model aligned with the target:
its entry at position i reads token ``t[i+1+j]`` and the layer below's output at i (for j = 0, the
target's pre-final-norm hidden state ``h[i]``), and writes K/V for position i into its own paged cache
(one KV group per MTP layer, sliding). With L tokens processed by the target and ``t[L]`` the last
committed token, drafting runs each layer over the positions it has not seen yet up to ``L-1``; the
entry at ``L-1`` yields draft ``j+1``. Entries that consumed a draft (``i+1+j > L``) are kept after the
verify only if that draft was accepted, so every layer's K/V is refreshed over accepted positions and is
never stale (docs/models.md §4).

Fixed shapes. A verify that accepted a drafts leaves layer j valid below ``L_old + min(0, a - j)`` and the
target at ``L = L_old + a + 1``, so the next round runs layer j over ``max(a + 1, j + 1) <= k + 1`` positions
per row (fewer for a row that stopped inside its chunk, none once it stopped). Every round but the first
therefore runs each layer over k + 1 right-aligned slots per row; a padding slot takes token 0 and state 0
and has no K/V slot (the attention reads nothing for it and outputs 0), so real slots compute what a
narrower forward computes. The first round catches up over the prompt, at its width. A layer's inputs are
slices and gathers of device tensors kept between rounds:

    tokens  t[L-k-1 .. L] per row: last round's, then its accepted drafts and the next token
    states  layer 0: the verify's pre-norm states of the kept slots, right-aligned; layer j > 0: the outputs
            of layer j-1 this round, and of its last round at the one position before them that layer j
            refreshes further back (at most one: layer j lacks at most one position more than layer j-1)

A round of k drafts runs layers 0..k-1. With ``num_speculative_tokens="auto"`` k may fall between rounds (never
rise within a request: a layer a round left out did not see that round's positions); the fixed width stays the
request's largest k + 1, so the first round after a fall still covers every position its layers lack.

With CUDA graphs on (the target's request uses them), a greedy round of those rounds (no logits processors) is
one graph replay of the batch's bucket: the round's tokens and layer 0's states from the last round's and the
verify's (the scatter and gathers above), every layer, the argmax of its head and the gathers between layers (kept in
the target's GraphStore per width, over the MTP caches' pooled storage: padding rows have no query, no key, no slot
and no page). Sampled rounds replay one graph per layer and select each draft eagerly from its outputs.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from hf_specdec.cache import ForwardMeta, ForwardPlan, KVGroup, KVLayout, PagedKVCache, to_device_async
from hf_specdec.generation.drafter import Drafter, DraftProposal, take_rows
from hf_specdec.kernels.argmax import argmax
from hf_specdec.runtime.placement import input_device, is_dispatched, layer_devices


@dataclass
class _Captured:
    pre_norm: torch.Tensor | None = None  # [batch, q_len, hidden] of the last target forward


class Step3p5MTPDraftRunner(Drafter):
    """Drives a Step 3.5 model's own MTP layers for the speculative loop (``spec_mode="mtp"``)."""

    spec_mode = "mtp"
    drops_rows = True  # its per-row state: its layers' caches and the round tensors below
    # its commit of a round after which "auto" k fell takes the round drafted ahead (:meth:`propose_ahead`): drafted
    # after the commit, a round whose k fell rolls back layers that did not run (tests/generation/test_adaptive_k.py)
    drafts_after_commit = False
    # "auto" k: a round of k drafts runs MTP layers 0..k-1; a layer left out stops seeing the new positions, so k
    # may fall within a request but not rise again (the next request starts with every layer)
    adaptive_k = True
    k_grows = False
    runs_ahead = True  # greedy rounds draft from the verify's acceptance on the device (propose_ahead)

    def __init__(self, target, num_speculative_tokens: int | None = None):
        if not getattr(target, "has_mtp", False):
            raise ValueError(
                "spec_mode='mtp' needs the model's MTP layers, but this Step 3.5 checkpoint has no MTP weights "
                "(num_nextn_predict_layers=0 or missing model.layers.{L+k}.* keys). Load a checkpoint with MTP "
                "layers, or call generate without spec_mode for plain decoding."
            )
        available = target.num_mtp_layers
        k = num_speculative_tokens or available
        if k > available:
            raise ValueError(f"num_speculative_tokens={k} but this checkpoint has {available} MTP layers; "
                             f"pass num_speculative_tokens <= {available}.")
        self.target = target
        self.num_speculative_tokens = k
        # slots per row of each layer's forward after the first round: for the most drafts a round may have (a
        # round of fewer, after one of more, still runs its layers over up to that many new positions)
        self.width = k + 1
        self.layer_indices = target.mtp_layer_indices[:k]
        self.ran = k  # the MTP layers the last round ran (0..ran-1): a later round of the request runs no more
        self.caches: list[PagedKVCache] = []
        # between rounds, on the device (see the module docstring)
        self.tokens: torch.Tensor | None = None  # [batch, width + 1] t[L-width .. L] of the last round
        self.drafted: torch.Tensor | None = None  # [batch, k] the last round's drafts
        self.accepted: torch.Tensor | None = None  # [batch] drafts the last verify accepted
        self.kept: torch.Tensor | None = None  # [batch] tokens each row kept at the last verify (0: stopped)
        self.hidden: torch.Tensor | None = None  # [batch, w, hidden] the prompt's states (the first round's layer 0)
        self.verified: torch.Tensor | None = None  # [batch, q, hidden] the last verify's pre-norm states
        self.below: list[torch.Tensor | None] = []  # per layer j < k-1: its outputs at L-width .. L-1 of the last round

    @contextlib.contextmanager
    def capture(self, target):
        """Record the pre-final-norm hidden states (the final norm's input) of every target forward."""
        captured = _Captured()
        handle = target.model.norm.register_forward_hook(
            lambda module, args, out: setattr(captured, "pre_norm", args[0]))
        try:
            yield captured
        finally:
            handle.remove()
            for cache in self.caches:
                cache.free()
            self.caches = []

    def begin(self, context, captured):
        config = self.target.config
        self.graphs = context.drafter_graphs("step3p5_mtp", id(self.target))
        self.caches = []
        # each MTP layer's cache where accelerate put the layer (runtime/placement.py)
        devices = ({layer: str(d) for layer, d in layer_devices(self.target).items()}
                   if is_dispatched(self.target) else {})
        for j, layer in enumerate(self.layer_indices):
            group = KVGroup(config.layer_num_kv_heads(layer), config.layer_head_dim(layer),
                            config.layer_sliding_window(layer), layers=(layer,), device=devices.get(layer))
            layout = KVLayout(groups=[group], layer_slot={layer: (0, 0)}, producer={layer: layer})
            # pooled storage per layer: kept graphs write into it in later requests too
            self.caches.append(context.new_cache(layout, f"step3p5_mtp{j}", dtype=context.cache.dtype))
            # drafting ahead, a round is queued before the last one's commit slides the window: keep a round more
            self.caches[-1].widen_windows(self.width)
        self.hidden = captured.pre_norm  # the prompt's states, right-aligned (left padding first)
        # the round's tensors live on the input device; layers that accelerate put elsewhere get theirs moved
        self.device = input_device(self.target)
        self.tokens = self.drafted = self.accepted = self.kept = self.verified = None
        self.below = [None] * (self.num_speculative_tokens - 1)
        self.ran = self.num_speculative_tokens
        self._ahead = False  # propose_ahead drafted from the last verify before its commit

    def _active_caches(self) -> list[PagedKVCache]:
        """The caches of the MTP layers this round runs (layers 0..k-1; the request's first rounds may have run
        more), remembered as the layers the round ran."""
        if self.num_speculative_tokens > self.ran:
            raise ValueError(f"num_speculative_tokens rose from {self.ran} to {self.num_speculative_tokens} within a "
                             "request: Step 3.5 MTP layers left out of a round are stale, so k may only fall.")
        self.ran = self.num_speculative_tokens
        return self.caches[:self.ran]

    @torch.inference_mode()
    def propose(self, last_tokens, context, selector) -> DraftProposal:
        lens = context.cache.seq_lens
        if self.tokens is not None and not selector.do_sample and not selector.scorer.processors:
            return DraftProposal(self._greedy_round(last_tokens.to(self.device), lens), None)
        width, tokens, states, shift = self._round_inputs(last_tokens, lens, selector)
        drafted, probs = tokens[:, :0], []
        active = self._active_caches()
        for j, mtp_cache in enumerate(active):
            plan = mtp_cache.plan_forward([n - s for s, n in zip(mtp_cache.seq_lens, lens)], width)
            new, ids, layer_states = _layer_inputs(j, width, tokens, drafted, states, plan.num_new)
            logits, outputs = self._run_layer(j, ids, layer_states, plan,
                                              graph=shift is not None)  # graphs at the fixed width only
            logits, outputs = logits.to(self.device), outputs.to(self.device)  # no-ops unless the layer is apart
            mtp_cache.commit(mtp_cache.seq_lens)
            token, q = selector.select(logits, drafted)
            drafted = torch.cat([drafted, token[:, None]], dim=1)
            probs.append(q)
            if j + 1 < len(active):
                states = self._below(j, outputs, new, shift)
        self.tokens, self.drafted = _last_columns(tokens, self.width + 1), drafted
        return DraftProposal(drafted, None if probs[0] is None else torch.stack(probs, dim=1))

    def _round_inputs(self, last_tokens, lens, selector):
        """(width, tokens t[L-width .. L] [batch, width + 1], layer 0's states [batch, width, hidden], and the slot
        of last round's outputs at each of this round's slots [batch, width]) for a round at the fixed width;
        the first round runs at the prompt's width, from the rows' ids, with no last round (None)."""
        if self.tokens is None:
            width = max(lens)
            tokens = torch.stack([p[p.shape[0] - (width + 1):] for p in selector.prefixes])
            return width, tokens.to(self.device), self.hidden[:, self.hidden.shape[1] - width:].to(self.device), None
        return self.width, *_round_state(last_tokens.to(self.device), *self._last_round())

    def _last_round(self) -> list[torch.Tensor]:
        """What a round's inputs are derived from (:func:`_round_state`), on the round's device: the last round's
        tokens and drafts, the last verify's accepted and kept counts and its pre-norm states (the drafts and the
        states padded to the fixed width's after a round of fewer drafts, which reads none of the padding: a round's
        graph does not depend on the last round's k)."""
        drafted, verified = self.drafted, self.verified
        if drafted.shape[1] < self.width - 1:
            drafted = torch.nn.functional.pad(drafted, (0, self.width - 1 - drafted.shape[1]))
        if verified.shape[1] < self.width:
            verified = torch.nn.functional.pad(verified, (0, 0, 0, self.width - verified.shape[1]))
        return [t.to(self.device) for t in (self.tokens, drafted, self.accepted, self.kept, verified)]

    def _greedy_round(self, last_tokens, lens) -> torch.Tensor:
        """A greedy round at the fixed width after the last verify's commit (host-planned forwards)."""
        active = self._active_caches()
        drafted = self._run_greedy_round(
            last_tokens, [c.plan_forward([n - s for s, n in zip(c.seq_lens, lens)], self.width) for c in active])
        for cache in active:
            cache.commit(cache.seq_lens)
        return drafted

    @torch.inference_mode()
    def propose_ahead(self, next_tokens, num_accepted, context, captured, selector) -> DraftProposal | None:
        """Greedy drafts of the next round before the last verify is committed: a row that keeps running commits
        ``a + 1`` tokens (``a``: its accepted drafts, on the device), so MTP layer j keeps its entries below
        ``L + min(0, a - j)`` (``L``: the verify's first position) and runs over the positions from there to
        ``L + a``, planned from device counts over blocks reserved for the longest case. Sampling and logits
        processors draft after the commit (``propose``), as does a round whose blocks do not fit."""
        if (selector.do_sample or selector.scorer.processors or self.tokens is None
                or context.forward_meta is None):
            return None
        active = self._active_caches()
        if not all(self.graphs.can_reserve(cache, self.width) for cache in active):
            return None  # (the commit's own append reports a pool that is really exhausted)
        first = context.forward_meta.q_pos0.to(device=self.device, dtype=torch.int32)
        self.accepted = num_accepted.to(self.device)
        self.kept, self.verified = self.accepted + 1, captured.pre_norm
        # per layer j: its entries before the round (L + min(0, a - j), at least 0) and the new ones (up to L + a)
        accepted = self.accepted.to(torch.int32)
        back = accepted[None, :] - torch.arange(len(active), device=self.device, dtype=torch.int32)[:, None]
        before = (first + back.clamp(max=0)).clamp(min=0)
        counts = torch.stack([before, first + accepted + 1 - before], dim=1)  # [layers, 2, batch]
        drafted = self._run_greedy_round(next_tokens.to(self.device),
                                         [c.plan_counts(counts[j].to(c.device), self.width)
                                          for j, c in enumerate(active)])
        self._ahead = True
        return DraftProposal(drafted.to(next_tokens.device), None)

    def _run_greedy_round(self, last_tokens, plans) -> torch.Tensor:
        """One greedy round over ``plans`` (one per active layer) as one call (one graph replay): the round's inputs
        from the last one's, every layer's forward over its planned entries, its draft by argmax, its outputs under
        the next layer's. Returns the drafts [batch, k]."""
        below = self.below[:len(plans) - 1]
        drafted, tokens, *below = self.graphs.run("greedy_round", self._greedy_layers,
                                                  [last_tokens, *self._last_round(), *below], plans=plans,
                                                  key=(len(plans),))
        self.below[:len(below)] = below
        self.tokens, self.drafted = tokens, drafted
        return drafted

    def _greedy_layers(self, last_tokens, last_round_tokens, last_drafted, accepted, kept, verified,
                       *below_and_metas):
        """(drafts [batch, k], the round's tokens, each layer j < k-1's outputs at this round's slots) of a greedy
        round; ``below``: each layer's outputs of the last round, ``metas``: each layer's forward."""
        tokens, states, shift = _round_state(last_tokens, last_round_tokens, last_drafted, accepted, kept, verified)
        layers = (len(below_and_metas) + 1) // 2  # below: one per layer but the last, metas: one per layer
        below, metas = below_and_metas[:layers - 1], below_and_metas[layers - 1:]
        drafted, outputs_below = tokens[:, :0], []
        for j, (mtp_cache, meta) in enumerate(zip(self.caches, metas)):
            new, ids, layer_states = _layer_inputs(j, self.width, tokens, drafted, states, meta.q_lens)
            with mtp_cache.forward_with(meta):
                logits, outputs = self._layer_forward(j, ids, layer_states, meta)
            logits, outputs = logits.to(tokens.device), outputs.to(tokens.device)  # no-ops unless the layer is apart
            drafted = torch.cat([drafted, argmax(logits)[:, None].to(drafted.dtype)], dim=1)
            if j + 1 < layers:
                states = _over_last(outputs, new, below[j], shift)
                outputs_below.append(states)
        return (drafted, tokens, *outputs_below)

    def _below(self, j: int, outputs: torch.Tensor, new: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
        """Layer j's outputs at this round's slots [batch, width, hidden], for layer j+1: this round's where layer j
        ran, else the last round's (kept for the next round's one position further back)."""
        if shift is not None:
            outputs = _over_last(outputs, new, self.below[j], shift)
        self.below[j] = _last_columns(outputs, self.width)
        return outputs

    def _run_layer(self, j: int, ids: torch.Tensor, states: torch.Tensor, plan: ForwardPlan, graph: bool):
        """MTP layer j over ids [batch, width] and states [batch, width, hidden] (right-aligned), appending its new
        entries' K/V to its cache -> (the last slot's logits [batch, vocab], outputs [batch, width, hidden]):
        eagerly, or replayed from a CUDA graph of the batch's bucket (its outputs are the graph's buffers,
        rewritten by the next replay: read them before)."""
        if not graph:
            return self._layer_forward(j, ids, states, self.caches[j].begin(plan))
        return self.graphs.run(f"layer{j}", functools.partial(self._layer_forward, j), [ids, states], plan=plan,
                               cache=self.caches[j])

    def _layer_forward(self, j: int, ids: torch.Tensor, states: torch.Tensor, meta: ForwardMeta):
        """MTP layer j's forward over ``meta`` (its cache's current forward)."""
        mtp_cache = self.caches[j]
        # a 4D mask passes transformers' mask builders untouched; the paged attention masks by positions
        stub = torch.ones(ids.shape[0], 1, 1, 1, dtype=torch.bool, device=ids.device)
        out = self.target.mtp_step(j, ids, states, position_ids=meta.position_ids, past_key_values=mtp_cache,
                                   attention_mask=stub, paged_cache=mtp_cache, logits_to_keep=1)
        return out.logits[:, -1], out.hidden_state

    def commit(self, context, captured, num_accepted, kept):
        self.ran = min(self.ran, self.num_speculative_tokens)  # a round without drafts ran no layer
        if self.ran == 0:
            # k fell to 0: no MTP layer runs again in this call (k does not rise within it), so nothing of this
            # round is kept (and the loop may have queued the next verify already, which rewrote what capture holds)
            return
        if self._ahead:
            # propose_ahead drafted from this round already (its states and counts taken on the device; what capture
            # holds is a later verify's now): every layer that round ran reached the target's committed tokens
            self._ahead = False
            for mtp_cache in self.caches[:self.ran]:
                mtp_cache.commit(context.committed_lens)
            return
        accepted = num_accepted.tolist()
        old = [n - k for n, k in zip(context.cache.seq_lens, kept)]
        for j, mtp_cache in enumerate(self.caches[:self.ran]):  # the layers this round ran
            # entries at positions >= L_old + a - j consumed a rejected draft: roll them back (a short prompt
            # may leave none)
            mtp_cache.commit([max(0, min(o, o + a - j)) if k else n for o, a, k, n
                              in zip(old, accepted, kept, mtp_cache.seq_lens)])
        # layer 0's next states are the verify's kept slots (the next round takes them, :func:`_round_state`)
        self.verified = captured.pre_norm  # [batch, k+1, hidden]: read before the next verify rewrites it
        self.kept = to_device_async([torch.tensor(kept)], self.verified.device)[0]
        self.accepted = num_accepted

    def keep_rows(self, rows):
        for cache in self.caches:
            cache.keep_rows(rows)
        self.tokens, self.drafted, self.accepted, self.kept, self.hidden, self.verified = (
            take_rows(x, rows) for x in (self.tokens, self.drafted, self.accepted, self.kept, self.hidden,
                                         self.verified))
        self.below = [take_rows(x, rows) for x in self.below]


def _round_state(last_tokens, last_round_tokens, last_drafted, accepted, kept, verified):
    """(tokens t[L-width .. L] [batch, width + 1], layer 0's states [batch, width, hidden], and the slot of last
    round's outputs at each of this round's slots [batch, width]) of a round at the fixed width, from the last
    round's t[L_old-width .. L_old] and drafts, the verify's accepted and kept counts and its pre-norm states
    (positions L_old ..), and each row's next token (recovered or bonus, at L_old + a + 1): on the device only."""
    width = last_round_tokens.shape[1] - 1
    slots = torch.arange(width + 1, device=last_tokens.device)
    kept = kept.to(last_tokens.device)
    # the tokens: the drafts with the next token over the first rejected one, shifted by the kept count
    seq = torch.cat([last_round_tokens, last_drafted, last_tokens[:, None].to(last_round_tokens.dtype)], dim=1)
    seq.scatter_(1, accepted.to(last_tokens.device)[:, None].long() + width + 1,
                 last_tokens[:, None].to(seq.dtype))
    tokens = seq.gather(1, kept[:, None] + slots)
    # layer 0's states: the verify's kept slots, right-aligned like a forward's
    index = (slots[None, :width] + kept[:, None] - width).clamp(min=0).to(verified.device)
    states = verified.gather(1, index[..., None].expand(-1, -1, verified.shape[-1])).to(last_tokens.device)
    shift = (kept[:, None] + slots[:width]).clamp(max=width - 1)  # a row that kept n tokens moved n slots
    return tokens, states, shift


def _layer_inputs(j: int, width: int, tokens: torch.Tensor, drafted: torch.Tensor, states: torch.Tensor,
                  num_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the rows' new entries [batch, width] (the last ``num_new[b]`` slots), MTP layer j's ids t[i+1+j] and states
    at the round's slots, zero where a row has no new entry)."""
    slots = torch.arange(width, device=tokens.device)
    new = slots[None, :] >= (width - num_new.to(tokens.device))[:, None]
    ids = torch.cat([tokens, drafted], dim=1)[:, 1 + j: 1 + j + width]
    return new, torch.where(new, ids, 0), torch.where(new[..., None], states, 0)


def _over_last(outputs: torch.Tensor, new: torch.Tensor, last: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """A layer's outputs [batch, width, hidden] where it ran this round, else its last round's outputs ``last`` at
    each slot's position then (``shift``: their slots)."""
    return torch.where(new[..., None], outputs, last.gather(1, shift[..., None].expand(-1, -1, outputs.shape[-1])))


def _last_columns(x: torch.Tensor, n: int) -> torch.Tensor:
    """The last ``n`` columns of ``x`` [batch, w, ...], with zero columns in front where w < n."""
    if x.shape[1] >= n:
        return x[:, x.shape[1] - n:]
    return torch.cat([x.new_zeros(x.shape[0], n - x.shape[1], *x.shape[2:]), x], dim=1)


def matches(target, assistant) -> bool:
    return assistant is None and getattr(target.config, "model_type", None) == "step3p5"


def build(target, assistant, num_speculative_tokens):
    return Step3p5MTPDraftRunner(target, num_speculative_tokens)
