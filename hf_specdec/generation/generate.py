"""The ``generate()`` override installed on an enabled model instance.

It takes the arguments a user's ``model.generate`` call takes, plus ``spec_mode`` and
``num_speculative_tokens`` (alias ``num_assistant_tokens``), which transformers would reject, and
routes the call:

- greedy / sampling decoding of ``input_ids``: through transformers' own ``generate`` with the paged
  loop (plain or speculative) as ``custom_generate`` (transformers prepares the config, processors and
  stopping criteria);
- what the paged loop does not cover (beam search, a user-supplied cache, ``inputs_embeds`` only, a
  user ``custom_generate``): transformers' own decoding, on the model's original attention.
"""

from __future__ import annotations

import copy
import functools

from transformers import GenerationMixin
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

from hf_specdec.generation.decode import paged_decode
from hf_specdec.generation.registry import build_drafter
from hf_specdec.generation.speculative import speculative_decode


def generate(self, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None, *,
             assistant_model=None, streamer=None, spec_mode: str | None = None,
             num_speculative_tokens: int | None = None, num_assistant_tokens: int | None = None, **kwargs):
    """``model.generate`` of an enabled model: paged, batched, and speculative when asked."""
    state = self._hf_specdec
    if num_speculative_tokens is None:
        num_speculative_tokens = num_assistant_tokens
    speculative = assistant_model is not None or spec_mode is not None
    if speculative:
        drafter = build_drafter(self, assistant_model, spec_mode, num_speculative_tokens)
        decode = functools.partial(speculative_decode, streamer=streamer, drafter=drafter)
    else:
        decode = functools.partial(paged_decode, streamer=streamer)
    if _needs_transformers_loop(self, inputs, generation_config, kwargs):
        if speculative:
            raise ValueError(
                "speculative decoding needs input_ids (not inputs_embeds alone), num_beams=1 and no "
                "past_key_values or custom_generate; drop those arguments or the assistant_model."
            )
        return GenerationMixin.generate(self, inputs, generation_config, logits_processor, stopping_criteria,
                                        streamer=streamer, **kwargs)
    generation_config, stopping_criteria = _stop_strings_to_criteria(self, generation_config, stopping_criteria, kwargs)
    with state.lock:
        return GenerationMixin.generate(self, inputs, generation_config, logits_processor, stopping_criteria,
                                        streamer=streamer, custom_generate=decode, **kwargs)


def _needs_transformers_loop(model, inputs, generation_config, kwargs) -> bool:
    config = generation_config if generation_config is not None else model.generation_config
    num_beams = kwargs.get("num_beams", config.num_beams) or 1
    has_ids = inputs is not None or kwargs.get("input_ids") is not None
    return (num_beams > 1 or not has_ids or kwargs.get("past_key_values") is not None
            or kwargs.get("custom_generate") is not None)


def _stop_strings_to_criteria(model, generation_config, stopping_criteria, kwargs):
    """transformers drops the tokenizer before calling a ``custom_generate``; build the stop-string
    criterion here so ``stop_strings=`` keeps working. Returns (generation_config, stopping_criteria)."""
    tokenizer = kwargs.pop("tokenizer", None)
    config = generation_config if generation_config is not None else model.generation_config
    stop_strings = kwargs.pop("stop_strings", None) or getattr(config, "stop_strings", None)
    if not stop_strings:
        return generation_config, stopping_criteria
    if tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate.")
    if getattr(config, "stop_strings", None):
        generation_config = copy.deepcopy(config)
        generation_config.stop_strings = None
    criteria = StoppingCriteriaList(stopping_criteria or [])
    criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
    return generation_config, criteria
