"""``hf_specdec.AutoModelForCausalLM``: transformers' loader followed by :func:`hf_specdec.enable`."""

from __future__ import annotations

import transformers

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
        # DFlash checkpoints say model_type "qwen3": transformers alone would build a Qwen3 model from them
        if is_dflash_checkpoint(pretrained_model_name_or_path, **kwargs):
            return load_dflash_drafter(pretrained_model_name_or_path, *args, **kwargs)
        model = transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if not isinstance(model, transformers.GenerationMixin):
            return model
        return enable(model, cache_config)
