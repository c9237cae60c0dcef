"""hf_specdec: fast, lossless speculative decoding for Hugging Face transformers.

    import hf_specdec
    model = hf_specdec.enable(model)          # same object, now paged + fast
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    stats = hf_specdec.last_generation_stats(model)
"""

from hf_specdec.attention import register as _register_attention
from hf_specdec.auto import AutoModelForCausalLM
from hf_specdec.config import CacheConfig, SpecDecodingConfig
from hf_specdec.generation import SpecStats, disable, enable, last_generation_stats
from hf_specdec.models import call_checks as _call_checks  # noqa: F401  (calls the paged loop leaves to transformers)
from hf_specdec.models import dflash as _dflash  # noqa: F401  (registers the DFlash drafter)
from hf_specdec.models import gemma4 as _gemma4  # noqa: F401  (registers the MTP assistant and its drafter)
from hf_specdec.models import gpt_oss as _gpt_oss  # noqa: F401  (registers its experts' gate with the MoE kernels)
from hf_specdec.models import rms_norms as _rms_norms  # noqa: F401  (Llama-family and gpt-oss norms in one kernel)
from hf_specdec.models import step3p5 as _step3p5  # noqa: F401  (registers Step3p5ForCausalLM and its MTP drafter)

__version__ = "0.1.0"
__all__ = [
    "AutoModelForCausalLM", "CacheConfig", "SpecDecodingConfig", "SpecStats", "disable", "enable",
    "last_generation_stats",
]

_register_attention()
