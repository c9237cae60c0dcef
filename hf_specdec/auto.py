"""``hf_specdec.AutoModelForCausalLM``: transformers' loader followed by :func:`hf_specdec.enable`."""

from __future__ import annotations

import pathlib

import torch
import transformers

from hf_specdec.assets import ASSETS_DIR
from hf_specdec.config import CacheConfig
from hf_specdec.generation import enable
from hf_specdec.models.dflash import is_dflash_checkpoint, load_dflash_drafter


class AutoModelForCausalLM:
    """Load a causal LM with transformers and enable hf_specdec on it; drafter checkpoints (a Gemma 4
    MTP assistant, a DFlash drafter) load as hf_specdec's drafter models and are returned as they are."""

    def __init__(self):
        raise TypeError("use hf_specdec.AutoModelForCausalLM.from_pretrained(path_or_id, **hf_kwargs)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, cache_config: CacheConfig | None = None,
                        **kwargs):
        kwargs = _bundled_defaults(pretrained_model_name_or_path, kwargs)
        # DFlash checkpoints say model_type "qwen3": transformers alone would build a Qwen3 model from them
        if is_dflash_checkpoint(pretrained_model_name_or_path, **kwargs):
            return load_dflash_drafter(pretrained_model_name_or_path, *args, **kwargs)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading info): output_loading_info=True
        if isinstance(model, transformers.GenerationMixin):
            enable(model, cache_config)
        return loaded


def _bundled_defaults(path, kwargs: dict) -> dict:
    """The bundled tiny family is stored in bf16; on CPU (no dtype and no device map given) it loads in float32,
    where greedy speculative output is token for token the plain greedy output (bf16 may round a verify of k+1
    tokens and a one-token decode differently and flip an argmax at a near-tie)."""
    if any(k in kwargs for k in ("dtype", "torch_dtype", "device_map")):
        return kwargs
    try:
        bundled = pathlib.Path(path).resolve().is_relative_to(ASSETS_DIR)
    except (TypeError, OSError):
        return kwargs
    return {**kwargs, "dtype": torch.float32} if bundled else kwargs
