"""Step 3.5 drafting with its own MTP layers: the Drafter the loop drives for ``step_model.generate(spec_mode="mtp")``.

Draft step j uses MTP layer j and its own head. MTP layer j is a sequence model aligned with the target:
its entry at position i reads token ``t[i+1+j]`` and the layer below's output at i (for j = 0, the
target's pre-final-norm hidden state ``h[i]``), and writes K/V for position i into its own paged cache
(one KV group per MTP layer, sliding). With L tokens processed by the target and ``t[L]`` the last
committed token, drafting runs each layer over the positions it has not seen yet up to ``L-1``; the
entry at ``L-1`` yields draft ``j+1``. Entries that consumed a draft (``i+1+j > L``) are kept after the
verify only if that draft was accepted, so every layer's K/V is refreshed over accepted positions and is
never stale (REFERENCE §4).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hf_specdec.cache import KVGroup, KVLayout, PagedKVCache
from hf_specdec.generation.drafter import DraftProposal


@dataclass
class _Captured:
    pre_norm: torch.Tensor | None = None  # [batch, q_len, hidden] of the last target forward


class Step3p5MTPDrafter:
    spec_mode = "mtp"

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
        self.layer_indices = target.mtp_layer_indices[:k]
        self.caches: list[PagedKVCache] = []
        self.pending: list[torch.Tensor] = []  # per row: target pre-norm hidden of positions MTP layer 0 lacks
        self.outputs: list[list[_RecentOutputs]] = []  # per MTP layer, per row

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

    def begin(self, cache, captured, prompt_lens):
        config = self.target.config
        self.caches = []
        for layer in self.layer_indices:
            group = KVGroup(config.layer_num_kv_heads(layer), config.layer_head_dim(layer),
                            config.layer_sliding_window(layer), layers=(layer,))
            layout = KVLayout(groups=[group], layer_slot={layer: (0, 0)}, producer={layer: layer})
            self.caches.append(PagedKVCache.for_request(
                layout, cache.cache_config, prompt_lens, cache.max_new_tokens, cache.lookahead,
                dtype=cache.dtype, device=cache.device))
        self.pending = [captured.pre_norm[b, captured.pre_norm.shape[1] - n:] for b, n in enumerate(prompt_lens)]
        keep = 2 * (self.num_speculative_tokens + 1)
        self.outputs = [[_RecentOutputs(keep) for _ in prompt_lens] for _ in self.layer_indices]

    @torch.inference_mode()
    def propose(self, last_tokens, cache, selector) -> DraftProposal:
        lens = cache.seq_lens
        drafted = last_tokens[:, None][:, :0]
        probs = []
        for j, mtp_cache in enumerate(self.caches):
            starts = mtp_cache.seq_lens  # each row's first position this layer has no valid entry for
            tokens = [_tokens(prefix, drafted[b], s + 1 + j, n, j)
                      for b, (prefix, s, n) in enumerate(zip(selector.prefixes, starts, lens))]
            below = self.pending if j == 0 else [w.slice(s, n) for w, s, n in zip(self.outputs[j - 1], starts, lens)]
            out = self._run_layer(j, mtp_cache, tokens, below)
            for b, (s, n) in enumerate(zip(starts, lens)):
                self.outputs[j][b].update(s, out.hidden_state[b, out.hidden_state.shape[1] - (n - s):])
            token, q = selector.select(out.logits[:, -1], drafted)
            drafted = torch.cat([drafted, token[:, None]], dim=1)
            probs.append(q)
        for window in (w for layer in self.outputs for w in layer):
            window.trim()
        return DraftProposal(drafted, None if probs[0] is None else torch.stack(probs, dim=1))

    def _run_layer(self, j: int, mtp_cache: PagedKVCache, tokens: list[torch.Tensor], hidden: list[torch.Tensor]):
        """MTP layer j over each row's new positions (right-aligned), appending their K/V to its cache."""
        counts = [t.shape[0] for t in tokens]
        width = max(counts)
        ref = next(h for h in hidden if h.shape[0])
        ids = torch.zeros(len(tokens), width, dtype=torch.long, device=ref.device)
        states = ref.new_zeros(len(tokens), width, ref.shape[-1])
        for b, (row_tokens, row_hidden, c) in enumerate(zip(tokens, hidden, counts)):
            if c:
                ids[b, width - c:] = row_tokens
                states[b, width - c:] = row_hidden
        meta = mtp_cache.begin_forward(counts, width)
        stub = torch.ones(len(tokens), 1, 1, 1, dtype=torch.bool, device=ref.device)
        out = self.target.mtp_step(j, ids, states, position_ids=meta.position_ids, past_key_values=mtp_cache,
                                   attention_mask=stub, paged_cache=mtp_cache, logits_to_keep=1)
        mtp_cache.commit(mtp_cache.seq_lens)
        return out

    def commit(self, cache, captured, num_accepted, kept):
        accepted = num_accepted.tolist()
        old = [n - k for n, k in zip(cache.seq_lens, kept)]
        for j, mtp_cache in enumerate(self.caches):
            # entries at positions >= L_old + a - j consumed a rejected draft: roll them back
            mtp_cache.commit([min(o, o + a - j) if k else n for o, a, k, n
                              in zip(old, accepted, kept, mtp_cache.seq_lens)])
        self.pending = [captured.pre_norm[b, :k] for b, k in enumerate(kept)]


class _RecentOutputs:
    """A layer's outputs at the last few positions of one row, for the layer above to refresh from."""

    def __init__(self, keep: int):
        self.keep = keep
        self.start = 0
        self.states: torch.Tensor | None = None  # [n, hidden] at positions start .. start+n-1

    def update(self, start: int, new: torch.Tensor) -> None:
        """New outputs for positions ``start ..``; older valid ones below ``start`` are kept."""
        if self.states is not None and start > self.start:
            new = torch.cat([self.states[: start - self.start], new])
            start = self.start
        self.start, self.states = start, new

    def trim(self) -> None:
        """Forget all but the last ``keep`` positions (a refresh never reaches further back)."""
        if self.states is not None and self.states.shape[0] > self.keep:
            drop = self.states.shape[0] - self.keep
            self.start, self.states = self.start + drop, self.states[drop:]

    def slice(self, first: int, stop: int) -> torch.Tensor:
        """Outputs at positions [first, stop)."""
        if first < self.start:
            raise RuntimeError(f"MTP refresh needs position {first}, only {self.start}.. are kept")
        return self.states[first - self.start: stop - self.start]


def _tokens(prefix: torch.Tensor, drafts: torch.Tensor, first: int, length: int, j: int) -> torch.Tensor:
    """Tokens ``t[first .. length + j]`` of a row, on its device: committed ones (index <= L = ``length``) from
    the row's ids ``prefix`` (left padding first, ``t[L]`` last), then this round's ``j`` drafts. Slicing
    only: nothing comes back to the host."""
    if first > length:
        return drafts[first - length - 1: j]
    return torch.cat([prefix[prefix.shape[0] - (length + 1) + first:], drafts[:j]])


def matches(target, assistant) -> bool:
    return assistant is None and getattr(target.config, "model_type", None) == "step3p5"


def build(target, assistant, num_speculative_tokens):
    return Step3p5MTPDrafter(target, num_speculative_tokens)
