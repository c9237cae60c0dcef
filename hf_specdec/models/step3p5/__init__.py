"""Step 3.5 (``stepfun-ai/Step-3.5-Flash``, model_type ``step3p5``) with its own MTP layers.

Importing this package registers ``Step3p5Config`` / ``Step3p5ForCausalLM`` with transformers'
``AutoConfig`` / ``AutoModelForCausalLM`` (``exist_ok=True``: model_type ``step3p5`` is also the text config
of transformers' Step 3.7, ``Step3p7TextConfig``, which has no causal LM and a different MTP layout). That
changes what ``AutoConfig`` makes of a StepFun Step 3.5 config.json only: Step 3.7 checkpoints and configs
transformers itself wrote still load as transformers' classes (``Step3p5Config.from_dict``). ``step3p7``
writes a ``Step3p5ForCausalLM`` as a checkpoint transformers' Step 3.7 loads (docs/models.md §4).
"""

from transformers import AutoConfig, AutoModelForCausalLM

from hf_specdec.generation.registry import DrafterBuilder, register_drafter
from hf_specdec.models.step3p5 import fusion, mtp_drafter

from hf_specdec.models.step3p5.configuration import Step3p5Config
from hf_specdec.models.step3p5.modeling import (
    Step3p5CausalLMOutputWithPast,
    Step3p5ForCausalLM,
    Step3p5Model,
    Step3p5MTPLayer,
    Step3p5MTPOutput,
    add_mtp_cache_layers,
)

AutoConfig.register(Step3p5Config.model_type, Step3p5Config, exist_ok=True)
AutoModelForCausalLM.register(Step3p5Config, Step3p5ForCausalLM, exist_ok=True)
fusion.register()
register_drafter(DrafterBuilder("mtp", mtp_drafter.matches, mtp_drafter.build,
                                "a Step 3.5 model drafting with its own MTP layers (no assistant_model)"))

__all__ = [
    "Step3p5Config", "Step3p5ForCausalLM", "Step3p5Model", "Step3p5MTPLayer", "Step3p5MTPOutput",
    "Step3p5CausalLMOutputWithPast", "add_mtp_cache_layers",
]
