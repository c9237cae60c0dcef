"""Token streams for training and evaluation.

A stream is the concatenation of `[bos] doc [eos]` over documents, in corpus order. Training draws
random windows of `seq_len + 1` tokens from it (inputs and next-token targets); evaluation covers a
stream with overlapping windows so every target is scored once, with at least `seq_len - stride`
tokens of context (the first window excepted).
"""

from dataclasses import dataclass

import torch


@dataclass
class TokenStream:
    ids: torch.Tensor  # [num_tokens] int64
    num_documents: int

    @classmethod
    def from_documents(cls, documents: list[list[int]]) -> "TokenStream":
        ids = torch.tensor([t for doc in documents for t in doc], dtype=torch.int64)
        return cls(ids, len(documents))

    def to(self, device: torch.device | str) -> "TokenStream":
        return TokenStream(self.ids.to(device), self.num_documents)


class RandomWindows:
    """Seeded sampler of training batches: `[batch_size, seq_len + 1]` windows at random offsets."""

    def __init__(self, stream: TokenStream, batch_size: int, seq_len: int, seed: int):
        self.stream = stream
        self.batch_size = batch_size
        self.span = torch.arange(seq_len + 1, device=stream.ids.device)
        self.max_start = stream.ids.numel() - seq_len - 1
        # Offsets are drawn on the CPU so the batch order is the same on every device.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self) -> torch.Tensor:
        starts = torch.randint(0, self.max_start + 1, (self.batch_size, 1), generator=self.generator)
        return self.stream.ids[starts.to(self.span.device) + self.span]  # [batch_size, seq_len + 1]


@dataclass
class EvalWindow:
    ids: torch.Tensor  # [seq_len + 1]; padded with `pad_id` past the end of the stream
    scored: torch.Tensor  # [seq_len] bool: which next-token targets this window scores


def eval_windows(stream: TokenStream, seq_len: int, stride: int, pad_id: int) -> list[EvalWindow]:
    """Overlapping windows that together score every target of the stream exactly once."""
    ids = stream.ids.cpu()
    num_targets = ids.numel() - 1
    windows, next_target = [], 0
    for start in range(0, num_targets, stride):
        chunk = ids[start : start + seq_len + 1]
        target_index = torch.arange(start, start + seq_len)  # index into targets = ids[1:]
        scored = (target_index >= next_target) & (target_index < num_targets)
        padded = torch.full((seq_len + 1,), pad_id, dtype=ids.dtype)
        padded[: chunk.numel()] = chunk
        windows.append(EvalWindow(padded, scored))
        next_target = start + seq_len
        if next_target >= num_targets:
            break
    return windows


def validation_windows(stream: TokenStream, count: int, seq_len: int, device) -> list[torch.Tensor]:
    """A fixed set of `count` validation windows of `seq_len` tokens (seeded), in batches of at most 16."""
    sample = RandomWindows(stream, count, seq_len - 1, seed=1234)()
    return [w.to(device) for w in sample.split(16)]
