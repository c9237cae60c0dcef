"""Drafters for testing the speculative loop without a trained assistant.

``CopyDrafter`` drafts with a stock copy of the target (full recompute per row, no cache): its drafts are
the target's greedy tokens, optionally corrupted with probability ``noise`` so that rows accept
different numbers of drafts. With ``do_sample`` it samples drafts from the processed copy distribution.
"""

from __future__ import annotations

import torch

from hf_specdec.generation.drafter import Drafter, DraftProposal


class CopyDrafter(Drafter):
    spec_mode = "mtp"

    def __init__(self, copy_model, k: int, noise: float = 0.0, seed: int = 0):
        self.model = copy_model
        self.num_speculative_tokens = k
        self.noise = noise
        self.gen = torch.Generator().manual_seed(seed)

    def begin(self, context, captured):
        pass

    def propose(self, last_tokens, context, selector):
        tokens, probs = [], []
        drafted = last_tokens.new_zeros(len(last_tokens), 0)
        real_lens = [n + 1 for n in context.cache.seq_lens]  # the cache holds all but the last token
        prefixes = [p[-n:] for p, n in zip(selector.prefixes, real_lens)]
        for _ in range(self.num_speculative_tokens):
            logits = self._next_logits([torch.cat([p, d]) for p, d in zip(prefixes, drafted)])
            token, q = selector.select(logits, drafted)
            if self.noise and q is None:
                flip = (torch.rand(len(token), generator=self.gen) < self.noise).to(token.device)
                noise = torch.randint(3, logits.shape[-1], token.shape, generator=self.gen).to(token.device)
                token = torch.where(flip, noise, token)
            tokens.append(token)
            probs.append(q)
            drafted = torch.cat([drafted, token[:, None]], dim=1)
        return DraftProposal(torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1))

    def _next_logits(self, sequences):
        """Last-position logits of each sequence, in one left-padded batch."""
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long, device=sequences[0].device)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, width - len(seq):] = seq
            mask[row, width - len(seq):] = 1
        with torch.no_grad():
            return self.model(ids, attention_mask=mask).logits[:, -1].float()

    def commit(self, context, captured, num_accepted, kept):
        pass
