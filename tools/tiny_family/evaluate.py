"""Cross-entropy and bits per byte over whole documents.

Each document (`[bos] text [eos]`) is scored on its own, with overlapping windows, so no file sees
another's tokens as context. bits/byte = (sum over scored tokens of -log2 p(token | context)) /
(UTF-8 bytes of the documents); the `<eos>` target is scored (the model must know where a file ends).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .corpus import Document
from .data import TokenStream, eval_windows

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # [batch, seq_len] ids -> [batch, seq_len, vocab] logits


@dataclass
class DocumentScore:
    nats: float
    num_tokens: int


def causal_lm_logits(model: torch.nn.Module) -> LogitsFn:
    return lambda input_ids: model(input_ids=input_ids, use_cache=False).logits


@torch.no_grad()
def score_documents(
    logits_fn: LogitsFn, documents: list[list[int]], seq_len: int, stride: int, batch_size: int, pad_id: int,
    device: torch.device | str, autocast_dtype: torch.dtype | None = None,
) -> list[DocumentScore]:
    """Summed next-token cross-entropy (nats) of each document, every target scored once."""
    windows = [(i, w) for i, doc in enumerate(documents)
               for w in eval_windows(TokenStream.from_documents([doc]), seq_len, stride, pad_id)]
    nats = torch.zeros(len(documents), dtype=torch.float64, device=device)
    counts = torch.zeros(len(documents), dtype=torch.int64, device=device)
    for start in range(0, len(windows), batch_size):
        group = windows[start : start + batch_size]
        doc_index = torch.tensor([i for i, _ in group], device=device)
        ids = torch.stack([w.ids for _, w in group]).to(device)  # [batch, seq_len + 1]
        scored = torch.stack([w.scored for _, w in group]).to(device)  # [batch, seq_len]
        with torch.autocast(torch.device(device).type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = logits_fn(ids[:, :-1])
        token_nats = F.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
        nats.index_add_(0, doc_index, (token_nats * scored).sum(dim=1).double())
        counts.index_add_(0, doc_index, scored.sum(dim=1))
    return [DocumentScore(n, c) for n, c in zip(nats.tolist(), counts.tolist())]


def bits_per_byte(total_nats: float, num_bytes: int) -> float:
    return total_nats / math.log(2) / num_bytes


@dataclass
class CausalLMScorer:
    """`score_documents` for a causal LM: windows of `seq_len` tokens, half a window apart."""

    seq_len: int
    batch_size: int
    pad_id: int
    device: torch.device | str

    def scores(self, model: torch.nn.Module, documents: list[list[int]],
               autocast_dtype: torch.dtype | None = None) -> list[DocumentScore]:
        return score_documents(causal_lm_logits(model), documents, self.seq_len, self.seq_len // 2, self.batch_size,
                               self.pad_id, self.device, autocast_dtype)

    def loss(self, model: torch.nn.Module, documents: list[list[int]],
             autocast_dtype: torch.dtype | None = None) -> float:
        """Mean nats per token over all `documents`."""
        scores = self.scores(model, documents, autocast_dtype)
        return sum(s.nats for s in scores) / sum(s.num_tokens for s in scores)


def split_scores(scores: list[DocumentScore], documents: list[Document]) -> dict:
    """The report's record of one split (validation or held-out files)."""
    nats, tokens = sum(s.nats for s in scores), sum(s.num_tokens for s in scores)
    num_bytes = sum(d.num_bytes for d in documents)
    return {"loss_nats_per_token": nats / tokens, "tokens": tokens, "bytes": num_bytes,
            "bits_per_byte": bits_per_byte(nats, num_bytes)}
