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
from dataclasses import dataclass

import torch

from hf_specdec.attention import QueryRows, paged_query_attention
from hf_specdec.generation.drafter import DraftProposal
from hf_specdec.models.gemma4.assistant import Gemma4MTPAssistant, target_embedding
from hf_specdec.models.gemma4.assistant_config import check_compatible, producer_layer_for, target_text_config

DEFAULT_NUM_SPECULATIVE_TOKENS = 4


@dataclass
class _Captured:
    hidden: torch.Tensor | None = None  # [batch, q_len, hidden] final-normed states of the last target forward


class PagedTargetKVSource:
    """``TargetKVSource`` over the target's paged cache: each assistant layer reads its producer's pages."""

    def __init__(self, cache, producers: dict[str, int], draft_positions: torch.Tensor):
        self.cache = cache
        self.producers = producers
        self.rows = QueryRows.at(draft_positions)  # [batch]: the draft position = the number of cached keys

    def attend(self, layer_type, query, *, scaling, sliding_window):
        return paged_query_attention(self.cache, self.producers[layer_type], query, self.rows,
                                     scaling=scaling, sliding_window=sliding_window)


class Gemma4MTPDrafter:
    spec_mode = "mtp"

    def __init__(self, target, assistant: Gemma4MTPAssistant, num_speculative_tokens: int | None = None):
        check_compatible(assistant, target)
        self.target = target
        self.assistant = assistant.to(device=target.device)
        self.num_speculative_tokens = num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS
        self.embed = target_embedding(target)
        text_config = target_text_config(target)
        layer_types = set(assistant.config.text_config.layer_types)
        self.producers = {t: producer_layer_for(text_config, t) for t in layer_types}
        self.hidden: torch.Tensor | None = None  # [batch, backbone_hidden] for the next round's step 0

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

    def begin(self, cache, captured, prompt_lens):
        self.hidden = captured.hidden[:, -1]  # the last slot is each row's last prompt token

    @torch.inference_mode()
    def propose(self, last_tokens, cache, selector) -> DraftProposal:
        positions = torch.tensor(cache.seq_lens, device=last_tokens.device)
        kv_source = PagedTargetKVSource(cache, self.producers, positions)
        tokens, hidden, drafted, probs = last_tokens, self.hidden, last_tokens[:, None][:, :0], []
        for _ in range(self.num_speculative_tokens):
            step = self.assistant.draft_step(tokens, hidden, positions, self.embed, kv_source)
            tokens, q = selector.select(step.logits, drafted)
            drafted = torch.cat([drafted, tokens[:, None]], dim=1)
            probs.append(q)
            hidden = step.hidden_next
        return DraftProposal(drafted, None if probs[0] is None else torch.stack(probs, dim=1))

    def commit(self, cache, captured, num_accepted, kept):
        index = num_accepted[:, None, None].expand(-1, 1, captured.hidden.shape[-1])
        self.hidden = captured.hidden.gather(1, index).squeeze(1)


def _final_norm(target) -> torch.nn.Module:
    """The final RMSNorm of a Gemma 4 text decoder, for Gemma4ForCausalLM and Gemma4ForConditionalGeneration."""
    model = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    language_model = getattr(model, "language_model", model)
    return language_model.norm


def matches(target, assistant) -> bool:
    return isinstance(assistant, Gemma4MTPAssistant)


def build(target, assistant, num_speculative_tokens):
    return Gemma4MTPDrafter(target, assistant, num_speculative_tokens)

