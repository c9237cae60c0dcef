"""Calls of transformers' own multimodal model classes whose masks or positions the paged loop does not reproduce.

The paged loop attends causally (each token to the keys at or before its position, within a sliding window) and
numbers positions one per token. Some models attend otherwise, or number otherwise, for some inputs:

- Gemma 4 with ``use_bidirectional_attention="vision"`` lets each image's or video's tokens (``mm_token_type_ids``
  1 or 2) attend to each other both ways; Gemma 3's image-text model does so for image tokens (``token_type_ids``
  1); a text config with ``use_bidirectional_attention`` True or ``"all"`` attends both ways everywhere.
- ``token_type_ids`` other than Gemma 3's: GPT-2 and its kin embed them at every step, PaliGemma's prefix attends
  both ways.
- DiffLlama and Doge attend in their own ways (differential attention; a dynamic mask of their own) at every call.
- Models whose rotary positions come from the images' and videos' grids (``image_grid_thw`` /
  ``video_grid_thw``: Qwen2-VL and its successors, GLM-4V) number an image's tokens by rows and columns.

Such a call goes to transformers' own loop (refused with a drafter): decoded through the paged loop its tokens would
differ from the model's, silently. Text-only calls of the same models run the paged loop.
"""

from __future__ import annotations

import torch

from hf_specdec.generation.registry import register_call_check


def _marks(tensor, types: tuple[int, ...]) -> bool:
    """Whether ``tensor`` (a call's token types) marks any token with one of ``types``."""
    return isinstance(tensor, torch.Tensor) and bool(torch.isin(tensor, torch.tensor(types, device=tensor.device))
                                                     .any())


def attention_both_ways(model, kwargs: dict) -> str | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    mode = getattr(config.get_text_config(), "use_bidirectional_attention", None)
    if mode is True or mode == "all":
        return f"bidirectional attention (use_bidirectional_attention={mode!r})"
    if mode == "vision" and _marks(kwargs.get("mm_token_type_ids"), (1, 2)):
        return ("image or video tokens that attend to each other both ways (use_bidirectional_attention='vision' "
                "with mm_token_type_ids)")
    if getattr(config, "model_type", None) == "gemma3" and _marks(kwargs.get("token_type_ids"), (1,)):
        return "image tokens that attend to each other both ways (Gemma 3 with token_type_ids)"
    return None


def token_types(model, kwargs: dict) -> str | None:
    """``token_type_ids`` that the model reads at every step (GPT-2 embeds them; transformers extends them each step,
    the paged steps pass token ids only) or that shape its mask (PaliGemma's prefix attends both ways). Gemma 3's
    image-text model reads them for its image tokens' mask alone (``attention_both_ways``)."""
    if kwargs.get("token_type_ids") is None or getattr(model.config, "model_type", None) == "gemma3":
        return None
    return "token_type_ids (read at every step or by the mask)"


# models whose attention reads other than the stored K/V with a causal mask, in shapes no check sees
_OWN_ATTENTION = {
    "diffllama": "differential attention (each half of the heads over a part of the values)",
    "doge": "an attention mask of its own (dynamic masks added to the scores)",
}


def attention_of_its_own(model, kwargs: dict) -> str | None:
    return _OWN_ATTENTION.get(getattr(getattr(model, "config", None), "model_type", None))


def grid_positions(model, kwargs: dict) -> str | None:
    passed = [name for name in ("image_grid_thw", "video_grid_thw") if kwargs.get(name) is not None]
    if passed:
        return f"rotary positions computed from the images' or videos' grids ({' / '.join(passed)})"
    return None


register_call_check(attention_both_ways)
register_call_check(grid_positions)
register_call_check(token_types)
register_call_check(attention_of_its_own)
