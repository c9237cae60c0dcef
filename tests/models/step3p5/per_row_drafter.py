"""The per-row, variable-width Step 3.5 MTP drafter: the oracle of the fixed-shape one.

Each round it builds every layer's inputs row by row on the host side of the loop (each row's tokens and the
layer below's outputs, sliced per row) at the width the round needs, ``max(counts)``; the fixed-shape drafter
must propose the same drafts and keep the same MTP K/V."""

from __future__ import annotations

import torch

from hf_specdec.generation.drafter import DraftProposal
from hf_specdec.models.step3p5.mtp_drafter import Step3p5MTPDraftRunner


class PerRowMTPDrafter(Step3p5MTPDraftRunner):
    def begin(self, context, captured):
        super().begin(context, captured)
        prompt_lens = context.prompt_lens
        self.pending = [captured.pre_norm[b, captured.pre_norm.shape[1] - n:] for b, n in enumerate(prompt_lens)]
        keep = 2 * (self.num_speculative_tokens + 1)
        self.outputs = [[_RecentOutputs(keep) for _ in prompt_lens] for _ in self.layer_indices]

    @torch.inference_mode()
    def propose(self, last_tokens, context, selector) -> DraftProposal:
        lens = context.cache.seq_lens
        drafted = last_tokens[:, None][:, :0]
        probs = []
        self.ran = self.num_speculative_tokens
        for j, mtp_cache in enumerate(self.caches[:self.ran]):  # a round of k drafts runs layers 0..k-1
            starts = mtp_cache.seq_lens
            tokens = [_tokens(prefix, drafted[b], s + 1 + j, n, j)
                      for b, (prefix, s, n) in enumerate(zip(selector.prefixes, starts, lens))]
            below = self.pending if j == 0 else [w.slice(s, n) for w, s, n in zip(self.outputs[j - 1], starts, lens)]
            out = self._run_rows(j, mtp_cache, tokens, below)
            for b, (s, n) in enumerate(zip(starts, lens)):
                self.outputs[j][b].update(s, out.hidden_state[b, out.hidden_state.shape[1] - (n - s):])
            token, q = selector.select(out.logits[:, -1], drafted)
            drafted = torch.cat([drafted, token[:, None]], dim=1)
            probs.append(q)
        for window in (w for layer in self.outputs for w in layer):
            window.trim()
        return DraftProposal(drafted, None if probs[0] is None else torch.stack(probs, dim=1))

    def _run_rows(self, j, mtp_cache, tokens, hidden):
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

    def commit(self, context, captured, num_accepted, kept):
        accepted = num_accepted.tolist()
        old = [n - k for n, k in zip(context.cache.seq_lens, kept)]
        for j, mtp_cache in enumerate(self.caches[:self.ran]):  # the layers the round ran
            mtp_cache.commit([min(o, o + a - j) if k else n for o, a, k, n
                              in zip(old, accepted, kept, mtp_cache.seq_lens)])
        self.pending = [captured.pre_norm[b, :k] for b, k in enumerate(kept)]


class _RecentOutputs:
    """A layer's outputs at the last few positions of one row."""

    def __init__(self, keep: int):
        self.keep = keep
        self.start = 0
        self.states: torch.Tensor | None = None  # [n, hidden] at positions start .. start+n-1

    def update(self, start: int, new: torch.Tensor) -> None:
        if self.states is not None and start > self.start:
            new = torch.cat([self.states[: start - self.start], new])
            start = self.start
        self.start, self.states = start, new

    def trim(self) -> None:
        if self.states is not None and self.states.shape[0] > self.keep:
            drop = self.states.shape[0] - self.keep
            self.start, self.states = self.start + drop, self.states[drop:]

    def slice(self, first: int, stop: int) -> torch.Tensor:
        if first < self.start:
            raise RuntimeError(f"MTP refresh needs position {first}, only {self.start}.. are kept")
        return self.states[first - self.start: stop - self.start]


def _tokens(prefix: torch.Tensor, drafts: torch.Tensor, first: int, length: int, j: int) -> torch.Tensor:
    """Tokens ``t[first .. length + j]`` of a row: committed ones from ``prefix`` (ending at ``t[length]``), then
    this round's ``j`` drafts."""
    if first > length:
        return drafts[first - length - 1: j]
    return torch.cat([prefix[prefix.shape[0] - (length + 1) + first:], drafts[:j]])
