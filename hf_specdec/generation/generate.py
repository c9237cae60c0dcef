"""The ``generate()`` override installed on an enabled model instance.

It takes the arguments a user's ``model.generate`` call takes, plus ``spec_mode`` and
``num_speculative_tokens`` (alias ``num_assistant_tokens``), which transformers would reject, and
routes the call:

- greedy / sampling decoding of ``input_ids``: through transformers' own ``generate`` with the paged
  loop (plain or speculative) as ``custom_generate`` (transformers prepares the config, processors and
  stopping criteria);
- what the paged loop does not cover (beam search, the other decoding methods of transformers'
  ``get_generation_mode``: contrastive search, DoLa, constrained beam search, its own assisted options; a
  user-supplied cache, ``inputs_embeds``, a user ``custom_generate``, per-step attentions or hidden states,
  what a model's registered call check names): transformers' own decoding, on the model's original
  attention; with a drafter these raise, naming what to drop;
- ``use_mtp=True`` on a model whose own MTP layers a registered drafter serves: ``spec_mode="mtp"``.

Bad input is rejected here, before transformers or the loop touch anything, with an error naming the fix.
One call runs at a time per model (other threads wait).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Mapping

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

from hf_specdec.cache.kv_layout import text_config_of
from hf_specdec.config import AUTO
from hf_specdec.generation.acceptance import Acceptance
from hf_specdec.generation.decode import paged_decode
from hf_specdec.generation.drafter import Drafter
from hf_specdec.generation.registry import build_drafter, call_unsupported, serves
from hf_specdec.generation.speculative import speculative_decode
from hf_specdec.runtime import check_mask_shape
from hf_specdec.runtime.placement import input_device, on_input_gpu


def generate(self, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None, *,
             assistant_model=None, streamer=None, spec_mode: str | None = None,
             num_speculative_tokens: int | str | None = None, num_assistant_tokens: int | str | None = None,
             acceptance: Acceptance | None = None, **kwargs):
    """``model.generate`` of an enabled model: paged, batched, and speculative when asked. ``acceptance``
    replaces the lossless acceptance of a speculative call (benchmarks pass a fixed acceptance rate; the call's
    stats then say ``lossless=False``)."""
    state = self._hf_specdec
    _check_attention(self)
    if num_speculative_tokens is not None and num_assistant_tokens is not None:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} and num_assistant_tokens="
                         f"{num_assistant_tokens!r} both set k, the drafts a round: pass one of them.")
    if num_speculative_tokens is None:
        num_speculative_tokens = num_assistant_tokens
    config = _call_config(self, generation_config, kwargs)
    if (assistant_model is None and spec_mode in (None, "mtp") and getattr(config, "use_mtp", False)
            and serves(self, None, "mtp")):
        # transformers' switch for drafting with a model's own MTP layers: hf_specdec's MTP mode does that here
        spec_mode = "mtp"
        kwargs.pop("use_mtp", None)
        if hasattr(GenerationConfig(), "use_mtp"):  # (a field since 5.24: off, or transformers' loop would take it)
            kwargs["use_mtp"] = False
            config = _call_config(self, generation_config, kwargs)
    speculative = assistant_model is not None or spec_mode is not None
    if num_speculative_tokens is not None and not speculative:
        raise ValueError(
            f"num_speculative_tokens={num_speculative_tokens} without a drafter: pass assistant_model=... (a Gemma 4 "
            "MTP assistant or a DFlash drafter) or spec_mode='mtp' (Step 3.5's own MTP layers), or drop it."
        )
    if acceptance is not None and not speculative:
        raise ValueError("acceptance= without a drafter: pass assistant_model=... or spec_mode=..., or drop it.")
    if (speculative and num_speculative_tokens is None and not isinstance(assistant_model, Drafter)
            and not config.do_sample):
        # greedy: k chosen per round where the drafter allows it (the output is the same whatever k). A sampled call
        # keeps the drafter's own k: the draws follow the rounds, and a seed must give the same tokens on every run,
        # whatever its rounds took to run. So does a Drafter passed as it is (built for its k)
        num_speculative_tokens = AUTO
    if speculative:
        drafter = build_drafter(self, assistant_model, spec_mode, num_speculative_tokens)
        # the model whose attention writes the drafter's own caches: the assistant, or the target's own layers
        draft_model = assistant_model if isinstance(assistant_model, torch.nn.Module) else self
        decode = functools.partial(speculative_decode, streamer=streamer, drafter=drafter, acceptance=acceptance,
                                   adaptive=num_speculative_tokens == AUTO, draft_model=draft_model)
    else:
        decode = functools.partial(paged_decode, streamer=streamer)
    if inputs is None and kwargs.get("input_ids") is None and kwargs.get("inputs_embeds") is None:
        inputs = _bos_prompt(self, config, kwargs)  # (None without a BOS token: transformers says what to pass)
    unsupported = (_paged_loop_unsupported(config, inputs, kwargs) or _rotary_switch(self, config, inputs, kwargs)
                   or call_unsupported(self, kwargs))
    if unsupported:
        if speculative:
            raise ValueError(f"speculative decoding does not support {unsupported}; drop it, or drop the "
                             "assistant_model / spec_mode to decode with transformers' own loop.")
        with _exclusive(self, state):
            state.last_stats = None  # transformers' loop counts nothing of ours
            return GenerationMixin.generate(self, inputs, generation_config, logits_processor, stopping_criteria,
                                            streamer=streamer, **kwargs)
    if speculative:
        _check_speculative_outputs(config)
    _check_input_shapes(inputs if inputs is not None else kwargs.get("input_ids"), kwargs.get("attention_mask"))
    stopping_criteria = _stop_strings_to_criteria(config, stopping_criteria, kwargs)
    with _exclusive(self, state), on_input_gpu(self):  # the loop's kernels launch on the input device's GPU
        try:
            with _no_autograd(self, assistant_model):
                output = GenerationMixin.generate(self, inputs, generation_config, logits_processor,
                                                  stopping_criteria, streamer=streamer, custom_generate=decode,
                                                  **kwargs)
            return _outside_inference_mode(output)
        except BaseException:
            if streamer is not None:
                streamer.end()  # a consumer iterating the streamer in another thread must not wait forever
            raise


def _no_autograd(model, assistant_model):
    """Inference mode, not transformers' no_grad, where every weight is a plain tensor: no autograd bookkeeping on
    any op (on a host-bound step, e.g. a small model on CPU, that bookkeeping is ~10% of the step). Quantized
    weights that are tensor subclasses (torchao's) may not implement the ops inference mode hands them (``.to``
    of a weight as ``aten.to``): those calls keep no_grad."""
    models = (model, assistant_model) if isinstance(assistant_model, torch.nn.Module) else (model,)
    plain = all(type(p) in (torch.nn.Parameter, torch.Tensor) for m in models for p in m.parameters())
    return torch.inference_mode() if plain else torch.no_grad()


def _outside_inference_mode(output):
    """``output`` with every tensor (sequences, per-step scores) usable as transformers' output is: an inference
    tensor refuses in-place edits (``out[out == eos] = pad``) and autograd outside inference mode."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output.is_inference() else output
    if isinstance(output, tuple):
        return tuple(_outside_inference_mode(t) for t in output)
    if isinstance(output, Mapping):  # a ModelOutput
        for name, value in output.items():
            output[name] = _outside_inference_mode(value)
    return output


def _check_attention(model) -> None:
    """The paged loop needs hf_specdec's attention; a later ``set_attn_implementation`` is refused, not mixed."""
    from hf_specdec.attention import ATTENTION_NAME

    current = model.config._attn_implementation
    if current != ATTENTION_NAME:
        raise ValueError(
            f"this model's attention was set to {current!r} after hf_specdec.enable, and hf_specdec's generate "
            f"needs its own: call hf_specdec.enable(model) again to decode through hf_specdec, or "
            f"hf_specdec.disable(model) to generate with transformers and {current!r}."
        )


@contextlib.contextmanager
def _exclusive(model, state):
    """One generate at a time per model (drafters hook the target's modules; stats are per model): other
    threads wait. A nested call from the same thread would wait forever, so it raises instead; a call that
    waited while another thread disabled the model raises rather than decode through a removed state."""
    me = threading.get_ident()
    if state.owner == me:
        raise RuntimeError(
            "model.generate was called from inside a generate call on the same model (from a streamer, logits "
            "processor or stopping criterion?); call it after the outer call returns, or on another model instance."
        )
    with state.lock:
        if getattr(model, "_hf_specdec", None) is not state:
            raise RuntimeError("hf_specdec.disable(model) ran while this generate call waited for the model; call "
                               "model.generate again (it is transformers' own now).")
        _check_attention(model)
        state.owner = me
        state.fuse_where_kernels_run(model)  # the model may have moved since enable (model.to(...))
        try:
            yield
        finally:
            state.owner = None


def _call_config(model, generation_config, kwargs) -> GenerationConfig:
    """The generation config this call decodes with, as transformers builds it: the call's kwargs over the passed
    config, whose unset fields take the model's defaults (``model.generation_config``). Every setting the routing
    reads comes from it (a passed config must not hide a default such as ``do_sample`` or ``stop_strings``)."""
    return model._prepare_generation_config(generation_config, **kwargs)[0]


# transformers' generation modes (`GenerationConfig.get_generation_mode`, without an assistant) that the paged loop
# decodes; any other goes to transformers' own loop (named here by the options that ask for it)
_PAGED_MODES = ("greedy_search", "sample")
_OTHER_MODES = {
    "contrastive_search": "contrastive search (penalty_alpha with top_k > 1)",
    "dola_generation": "DoLa decoding (dola_layers)",
    "constrained_beam_search": "constrained beam search (force_words_ids / constraints)",
    "assisted_generation": "transformers' own assisted generation (prompt_lookup_num_tokens, assistant_early_exit, "
                           "use_mtp)",
}


def _bos_prompt(model, config, kwargs) -> torch.Tensor | None:
    """The prompt transformers starts a call without one from: each row's BOS token (one row, or as many as the
    first tensor among the call's arguments has), or None where the config has no BOS token."""
    if config.bos_token_id is None:
        return None
    rows = next((v.shape[0] for v in kwargs.values() if isinstance(v, torch.Tensor) and v.dim()), 1)
    bos = config.bos_token_id
    bos = bos[0] if isinstance(bos, (list, tuple)) else int(bos)
    return torch.full((rows, 1), bos, dtype=torch.long, device=input_device(model))


def _paged_loop_unsupported(config, inputs, kwargs) -> str | None:
    """What in this call (``config``: :func:`_call_config`) needs transformers' own loop (beam search, a user
    cache, ...), or None."""
    num_beams = config.num_beams or 1
    if num_beams > 1:
        return f"beam search (num_beams={num_beams})"
    mode = config.get_generation_mode()
    mode = str(getattr(mode, "value", mode))
    if mode not in _PAGED_MODES:
        return _OTHER_MODES.get(mode, mode.replace("_", " "))
    if kwargs.get("inputs_embeds") is not None:  # the paged prefill reads token ids
        return "inputs_embeds"
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            return f"a user-supplied {name}"
    if kwargs.get("custom_generate") is not None:
        return "custom_generate"
    if inputs is None and kwargs.get("input_ids") is None:
        return "a call without a prompt (pass input_ids, or set the generation config's bos_token_id)"
    if config.return_dict_in_generate:
        wanted = [n for n in ("output_attentions", "output_hidden_states") if getattr(config, n, False)]
        if wanted:
            return " / ".join(f"{n}=True" for n in wanted)
    return None


def _rotary_switch(model, config, inputs, kwargs) -> str | None:
    """Longrope rotary (Phi-3 long-context models) uses other factors from ``original_max_position_embeddings`` on:
    transformers' loop drops its cache when a call's sequence first grows past it and encodes every position again
    with the long factors, which cached pages cannot follow. Such calls take transformers' loop."""
    text = text_config_of(model.config)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    rope = rope if isinstance(rope, Mapping) else {}
    original = getattr(text, "original_max_position_embeddings", None) or rope.get("original_max_position_embeddings")
    if rope.get("rope_type", rope.get("type")) != "longrope" or not original:
        return None
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    width = ids.shape[1]
    last = width + config.max_new_tokens if config.max_new_tokens is not None else (config.max_length or width)
    if width <= original < last:
        return (f"a call whose sequence grows past original_max_position_embeddings={original} with longrope rotary "
                "(its positions are encoded again with the long factors there)")
    return None


def _check_speculative_outputs(config) -> None:
    """The speculative loop returns sequences only; refuse per-step outputs rather than return None for them."""
    if not config.return_dict_in_generate:
        return
    wanted = [n for n in ("output_scores", "output_logits") if getattr(config, n, False)]
    if wanted:
        raise ValueError(
            f"speculative decoding returns sequences only, not {' / '.join(wanted)}; drop "
            f"{', '.join(f'{n}=True' for n in wanted)}, or drop the assistant_model / spec_mode to get them."
        )


def _check_input_shapes(input_ids, attention_mask) -> None:
    """Shapes transformers would broadcast or fail on obscurely, rejected with the fix."""
    if not isinstance(input_ids, torch.Tensor):
        return  # transformers reports the type
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2D [batch, sequence], got shape {tuple(input_ids.shape)}; "
                         "add the batch dimension (input_ids[None]) or use the tokenizer's return_tensors='pt'.")
    if input_ids.shape[0] == 0:
        raise ValueError(f"input_ids has no rows (shape {tuple(input_ids.shape)}); pass at least one prompt.")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids has no tokens; give every prompt at least one token (for example the "
                         "tokenizer's BOS token: tokenize with add_special_tokens=True).")
    check_mask_shape(input_ids, attention_mask)


def _stop_strings_to_criteria(config, stopping_criteria, kwargs):
    """transformers drops the tokenizer before calling a ``custom_generate``; build the stop-string
    criterion here so ``stop_strings=`` keeps working, from the call's, the passed config's or the model's
    (``config``: :func:`_call_config`), and turn transformers' own off for the call. Returns the stopping
    criteria."""
    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = config.stop_strings
    if not stop_strings:
        return stopping_criteria
    if tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate.")
    kwargs["stop_strings"] = None  # over the passed config's and the model's: the criterion below checks them
    criteria = StoppingCriteriaList(stopping_criteria or [])
    criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
    return criteria
