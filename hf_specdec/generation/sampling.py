"""Token selection from processed scores, exactly as transformers' ``_sample`` does it."""

from __future__ import annotations

import torch


def select_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """scores [batch, vocab] (after logits processors) -> tokens [batch]."""
    if do_sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)


def mask_finished(tokens: torch.Tensor, unfinished: torch.Tensor, pad_token_id: torch.Tensor | None) -> torch.Tensor:
    """Rows that already stopped emit the pad token, like transformers."""
    if pad_token_id is None:
        raise ValueError(
            "generation stops at EOS but no pad_token_id is set; pass pad_token_id= to generate "
            "(for example the tokenizer's pad or eos id)."
        )
    return tokens * unfinished + pad_token_id * (1 - unfinished)
