"""The assistant's LM heads and the draft-logits types the generation loop consumes.

Two heads share one interface (`DraftLogits`):
- the centroid head (`use_ordered_embeddings=True`, checkpoint prefix `masked_embedding.`): the top
  `centroid_intermediate_top_k` of `num_centroids` centroid logits select candidate tokens through
  `token_ordering` (each centroid owns `vocab_size // num_centroids` consecutive entries of it); logits are
  computed only for those rows of the tied LM head. Result: `CandidateLogits`, never a full-vocab tensor.
- the plain tied LM head: `DenseLogits` over the whole vocabulary.

Tokens outside the candidates have probability 0 (logit -inf). transformers' `Gemma4AssistantMaskedEmbedder`
instead fills them with `min(selected) - 1` after a host sync, which gives them non-zero probability under
sampling; we keep the candidate set exact.

Everything here is free of host syncs (`*_no_sync`), so it can run inside a captured draft step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from hf_specdec.kernels._dispatch import needs_grad
from hf_specdec.kernels.gather_matvec import (
    centroid_candidates,
    centroid_candidates_reference,
    gather_matvec,
    gather_matvec_reference,
)

Temperature = float | torch.Tensor  # a float > 0, or a tensor [batch] of them


class CentroidHead(nn.Module):
    """Centroid LM head; its parameter names match the checkpoint's `masked_embedding.*` keys."""

    token_ordering: torch.Tensor

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int, top_k: int):
        super().__init__()
        self.vocab_size, self.num_centroids, self.top_k = vocab_size, num_centroids, top_k
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.arange(vocab_size, dtype=torch.long))

    def forward(
        self,
        hidden: torch.Tensor,  # [batch, hidden]
        lm_head_weight: torch.Tensor,  # [vocab, hidden]
        cap: float | None = None,  # Gemma's final logit soft-cap of the candidates' logits (None: none)
        scores: torch.Tensor | None = None,  # [batch, num_centroids] `centroids(hidden)` if the caller has them
    ) -> CandidateLogits:
        # the candidates of the top_k centroids ([batch, top_k * vocab // num_centroids], each centroid owning
        # consecutive entries of token_ordering), and their rows of the LM head times hidden: each one kernel on
        # the GPU (gather_matvec reads each row once and soft-caps in fp32); under autograd and on CPU torch's
        # top-k, the embedding lookup + bmm and the soft-cap
        if scores is None:
            scores = self.centroids(hidden)  # [batch, num_centroids]
        if needs_grad(hidden) or needs_grad(lm_head_weight):
            token_ids = centroid_candidates_reference(scores, self.token_ordering, self.top_k)
            return CandidateLogits(token_ids, gather_matvec_reference(lm_head_weight, token_ids, hidden, cap),
                                   self.vocab_size)
        token_ids = centroid_candidates(scores, self.token_ordering, self.top_k)
        return CandidateLogits(token_ids, gather_matvec(lm_head_weight, token_ids, hidden, cap), self.vocab_size)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`cap * tanh(logits / cap)` (Gemma's final logit soft-cap); identity when `cap` is None."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


@dataclass(frozen=True)
class CandidateLogits:
    """Logits of a few candidate tokens per row; every other token has logit -inf."""

    token_ids: torch.Tensor  # [batch, n_cand] int64, distinct within a row
    logits: torch.Tensor  # [batch, n_cand]
    vocab_size: int

    def argmax(self) -> torch.Tensor:
        return argmax_no_sync(self)

    def rows(self, n: int) -> CandidateLogits:
        """The first ``n`` rows (of a padded batch)."""
        return CandidateLogits(self.token_ids[:n], self.logits[:n], self.vocab_size)

    def sample(self, temperature: Temperature, generator: torch.Generator | None = None):
        return sample_no_sync(self, temperature, generator)

    def token_prob(self, tokens: torch.Tensor, temperature: Temperature) -> torch.Tensor:
        """Probability of `tokens` [batch] under this distribution -> [batch] (0 for non-candidates)."""
        hit = self.token_ids == tokens.unsqueeze(-1)  # [batch, n_cand]
        return (probs(self, temperature) * hit).sum(-1)

    def dense_logits(self) -> torch.Tensor:
        """[batch, vocab] logits, -inf outside the candidates (for logits processors)."""
        full = self.logits.new_full((self.logits.shape[0], self.vocab_size), float("-inf"))
        return full.scatter(-1, self.token_ids, self.logits)

    def dense_probs(self, temperature: Temperature) -> torch.Tensor:
        """[batch, vocab] fp32 probabilities, 0 outside the candidates (for the rejection residual)."""
        full = torch.zeros(self.logits.shape[0], self.vocab_size, device=self.logits.device)
        return full.scatter(-1, self.token_ids, probs(self, temperature))


@dataclass(frozen=True)
class DenseLogits:
    """Full-vocabulary logits (assistant without ordered embeddings); same interface as `CandidateLogits`."""

    logits: torch.Tensor  # [batch, vocab]

    @property
    def vocab_size(self) -> int:
        return self.logits.shape[-1]

    def argmax(self) -> torch.Tensor:
        return self.logits.argmax(-1)

    def rows(self, n: int) -> DenseLogits:
        """The first ``n`` rows (of a padded batch)."""
        return DenseLogits(self.logits[:n])

    def sample(self, temperature: Temperature, generator: torch.Generator | None = None):
        return _sample_index_no_sync(self.logits, temperature, generator)

    def token_prob(self, tokens: torch.Tensor, temperature: Temperature) -> torch.Tensor:
        return softmax_with_temperature(self.logits, temperature).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def dense_logits(self) -> torch.Tensor:
        return self.logits

    def dense_probs(self, temperature: Temperature) -> torch.Tensor:
        return softmax_with_temperature(self.logits, temperature)


DraftLogits = CandidateLogits | DenseLogits


def softmax_with_temperature(logits: torch.Tensor, temperature: Temperature) -> torch.Tensor:
    """fp32 `softmax(logits / temperature)` over the last dim; -inf logits get probability exactly 0."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(torch.float32).unsqueeze(-1)
    elif temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling (use argmax for greedy), got {temperature}.")
    return torch.softmax(logits.float() / temperature, dim=-1)


def probs(cands: CandidateLogits, temperature: Temperature) -> torch.Tensor:
    """Probabilities of the candidates, [batch, n_cand] fp32, summing to 1 per row."""
    return softmax_with_temperature(cands.logits, temperature)


def argmax_no_sync(cands: CandidateLogits) -> torch.Tensor:
    """Token id of the highest candidate logit per row -> [batch]."""
    best = cands.logits.argmax(-1, keepdim=True)  # [batch, 1]
    return cands.token_ids.gather(-1, best).squeeze(-1)


def sample_no_sync(
    cands: CandidateLogits, temperature: Temperature, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one candidate per row -> (token [batch], its probability [batch])."""
    index, prob = _sample_index_no_sync(cands.logits, temperature, generator)
    return cands.token_ids.gather(-1, index.unsqueeze(-1)).squeeze(-1), prob


def _sample_index_no_sync(
    logits: torch.Tensor,  # [batch, n]
    temperature: Temperature,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exponential-race sampling (argmax of p / Exp(1) is distributed as p) without `torch.multinomial`'s sync."""
    p = softmax_with_temperature(logits, temperature)
    race = torch.empty_like(p).exponential_(generator=generator).clamp_min_(torch.finfo(p.dtype).tiny)
    index = (p / race).argmax(-1)  # [batch]
    return index, p.gather(-1, index.unsqueeze(-1)).squeeze(-1)
