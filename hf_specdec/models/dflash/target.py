"""What a DFlash drafter borrows from its target: hidden states of chosen layers, the input embedding, the head.

Works for Gemma 4 (`Gemma4ForCausalLM`, `Gemma4ForConditionalGeneration`) and generic HF decoders (Llama,
Qwen3, ...): anything whose text decoder has `.layers` and a final `.norm`.

- `target_layer_hidden_modules(target, layer_ids)`: the modules whose forward output is HF's
  `output_hidden_states[i + 1]` for each target layer `i`; hook them during the target's own forward.
- `target_block_embeddings(target, input_ids, scale)`: the block embedded the way the reference does.
- `target_head_logits(target, hidden)`: the target's lm_head plus its final logit soft-cap.
- `check_compatible(drafter_config, target)`: a `ValueError` naming the fix for a wrong pair.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


def text_decoder(target: nn.Module) -> nn.Module:
    """The text decoder (`...Model` holding `.layers` and `.norm`) of a causal LM or Gemma 4 multimodal model."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    decoder = getattr(decoder, "language_model", decoder)
    if not (hasattr(decoder, "layers") and hasattr(decoder, "norm")):
        raise ValueError(f"cannot find the decoder layers and final norm of {type(target).__name__} for DFlash.")
    return decoder


def target_layer_hidden_modules(target: nn.Module, layer_ids: Sequence[int]) -> list[nn.Module]:
    """For each target layer id `i`, the module whose output is HF's `output_hidden_states[i + 1]`.

    That is decoder layer `i` itself, except for the last layer: transformers reports the final hidden
    state *after* the final norm (`tie_last_hidden_states`), so the final norm stands in for it. A module's
    output may be a tensor or a tuple whose first item is the hidden state [batch, seq, hidden].

    Gemma 4 with KV-shared layers (E2B/E4B, transformers >= 5.2x) computes only the kept positions in
    those layers when called with an integer `logits_to_keep > 0` and no `output_hidden_states`; pass the
    kept positions as an index tensor instead (`logits_to_keep=torch.tensor([seq - 1])`) to capture them all.
    """
    decoder = text_decoder(target)
    layers = decoder.layers[: target.config.get_text_config().num_hidden_layers]
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"target layer ids {bad} out of range for a target with {len(layers)} layers.")
    return [decoder.norm if i == len(layers) - 1 else layers[i] for i in layer_ids]


@contextlib.contextmanager
def capture_hidden_states(target: nn.Module, layer_ids: Sequence[int]) -> Iterator[list[torch.Tensor | None]]:
    """Record, while open, the hidden states after `layer_ids` of every target forward.

    Yields a list with one slot per layer id, overwritten by each forward: [batch, seq, hidden] tensors
    equal to `output_hidden_states[i + 1]` of the last forward.
    """
    captured: list[torch.Tensor | None] = [None] * len(layer_ids)

    def hook(slot: int):
        def record(module, args, output):
            captured[slot] = output[0] if isinstance(output, tuple) else output
        return record

    modules = target_layer_hidden_modules(target, layer_ids)
    handles = [m.register_forward_hook(hook(slot)) for slot, m in enumerate(modules)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def target_block_embeddings(
    target: nn.Module,
    input_ids: torch.Tensor,  # [batch, block_len]
    scale: float | None = None,
) -> torch.Tensor:  # [batch, block_len, hidden]
    """Embed draft-block tokens with the target's input embedding, as the references do.

    - `scale` set (the drafter's `input_embedding_scale`): z-lab's rule, the raw table row times `scale`;
    - an embedding with an `embed_norm` (e.g. MuseGlimmer): the raw row, norm skipped (transformers' DFlash);
    - otherwise the module as is: Gemma 4's scaled embedding (x sqrt(hidden), as vLLM's Gemma 4 DFlash
      does), a plain table for Llama/Qwen3.
    """
    embed = target.get_input_embeddings()
    if scale is not None:
        return F.embedding(input_ids, embed.weight) * scale
    if getattr(embed, "embed_norm", None) is not None:
        return F.embedding(input_ids, embed.weight, embed.padding_idx)
    return embed(input_ids)


def target_final_softcap(target: nn.Module) -> float | None:
    """The target's final logit soft-cap (Gemma 4: 30.0), or None."""
    return getattr(target.config.get_text_config(), "final_logit_softcapping", None)


def head_logits(
    target: nn.Module,
    hidden: torch.Tensor,  # [..., hidden]
    *,
    multiplier: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:  # [..., vocab]
    """`softcap * tanh(multiplier * lm_head(hidden) / softcap)` with the target's lm_head (no soft-cap if None)."""
    logits = target.get_output_embeddings()(hidden.to(target.get_output_embeddings().weight.dtype))
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def target_head_logits(target: nn.Module, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
    """The target's logits for final-normed hidden states: its lm_head and its final soft-cap, as in its forward."""
    return head_logits(target, hidden, softcap=target_final_softcap(target))


def check_compatible(drafter_config, target: nn.Module) -> None:
    """Raise `ValueError` naming the fix when this drafter cannot draft for this target."""
    drafter_config = getattr(drafter_config, "config", drafter_config)
    text = target.config.get_text_config()
    settings = drafter_config.dflash
    if drafter_config.hidden_size != text.hidden_size:
        raise ValueError(
            f"this DFlash drafter has hidden_size {drafter_config.hidden_size} but the target has {text.hidden_size}; "
            f"load the drafter built for this target."
        )
    expected = drafter_config.num_target_layers
    if expected is not None and expected != text.num_hidden_layers:
        raise ValueError(
            f"this DFlash drafter was trained on a target with {expected} layers (num_target_layers) but the target "
            f"has {text.num_hidden_layers}; load the drafter built for this target."
        )
    if max(settings.target_layer_ids) >= text.num_hidden_layers:
        raise ValueError(
            f"dflash_config.target_layer_ids {list(settings.target_layer_ids)} index past the target's "
            f"{text.num_hidden_layers} layers; load the drafter built for this target."
        )
    if settings.mask_token_id >= text.vocab_size:
        raise ValueError(
            f"dflash_config.mask_token_id {settings.mask_token_id} is outside the target vocabulary "
            f"({text.vocab_size}); load the drafter built for this target."
        )
