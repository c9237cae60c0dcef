"""Bad input, across modes: each call raises the exact error type with a message that names the fix, or is
supported and gives transformers' answer — never a silent wrong answer.

Models (tests/bundled.py): the bundled tiny Gemma 4 with its MTP assistant, the bundled tiny Step 3.5 with
its 3 MTP layers, a DFlash drafter for the tiny Gemma 4 (skipped with the reason while none is registered);
tiny random configs for mismatched assistants.
"""

import threading

import pytest
import torch
from transformers import TextIteratorStreamer

import hf_specdec
from hf_specdec.assets import asset_path
from hf_specdec.cache import CacheCapacityError
from tests import bundled
from tests.models.gemma4.helpers import assistant_config_dict, random_state_dict, released_layout, write_checkpoint
from tests.models.step3p5 import tiny_step3p5
from tests.tiny_models import gemma4_e2b_style, left_padded_batch, llama

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
SPEC_MODES, MODES = bundled.SPEC_MODES, bundled.MODES


@pytest.fixture
def gemma():
    """(enabled tiny-gemma4, its MTP assistant, a stock copy of the target)."""
    return bundled.gemma()


@pytest.fixture
def step():
    return bundled.step()[0]


def _batch(lengths=(7, 4), vocab=4096):
    return left_padded_batch(list(lengths), vocab=vocab)


def _random_assistant(tmp_path, target, name="assistant"):
    config = assistant_config_dict(target.config, True)
    path = write_checkpoint(tmp_path / name, config, random_state_dict(released_layout(config)))
    return hf_specdec.AutoModelForCausalLM.from_pretrained(path)


def _dflash_drafter(target, **kwargs):
    """A random DFlash drafter for ``target``, or skip while no builder serves spec_mode="dflash"."""
    if not bundled.dflash_registered():
        pytest.skip("no DFlash drafter is registered for spec_mode='dflash' yet (hf_specdec.models.dflash)")
    from tests.models.dflash.helpers import random_drafter

    return random_drafter(target, **kwargs)


# ---- speculative mode and drafter --------------------------------------------------------------------------
@pytest.mark.parametrize("with_assistant", [True, False])
def test_unknown_spec_mode_lists_the_modes(gemma, with_assistant):
    target, assistant, _ = gemma
    ids, mask = _batch()
    extra = dict(assistant_model=assistant) if with_assistant else {}
    with pytest.raises(ValueError, match=r"unknown spec_mode 'eagle'; use one of \('mtp', 'dflash'\)"):
        target.generate(ids, attention_mask=mask, spec_mode="eagle", max_new_tokens=3, **GREEDY, **extra)


def test_dflash_mode_with_an_mtp_assistant_names_the_right_mode(gemma):
    target, assistant, _ = gemma
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"it is a 'mtp' drafter .* Pass spec_mode='mtp' or leave spec_mode out"):
        target.generate(ids, attention_mask=mask, assistant_model=assistant, spec_mode="dflash", max_new_tokens=3)


def test_dflash_mode_on_step3p5_names_its_mtp_mode(step):
    ids, mask = _batch(vocab=4096)
    with pytest.raises(ValueError, match=r"Pass spec_mode='mtp'"):
        step.generate(ids, attention_mask=mask, spec_mode="dflash", max_new_tokens=3)


def test_mtp_mode_with_a_dflash_drafter_names_the_right_mode():
    target = hf_specdec.enable(gemma4_e2b_style())
    drafter = _dflash_drafter(target)
    ids, mask = _batch(vocab=97)
    with pytest.raises(ValueError, match=r"it is a 'dflash' drafter .* Pass spec_mode='dflash' or leave spec_mode out"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, spec_mode="mtp", max_new_tokens=3)


def test_mtp_mode_on_gemma_without_an_assistant_says_what_to_pass(gemma):
    target, _, _ = gemma
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"no speculative mode fits .*gemma4_assistant.* Pass the drafter built"):
        target.generate(ids, attention_mask=mask, spec_mode="mtp", max_new_tokens=3)


def test_a_plain_causal_lm_as_assistant_points_to_disable(gemma):
    target, _, reference = gemma
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"call hf_specdec.disable\(model\) first"):
        target.generate(ids, attention_mask=mask, assistant_model=reference, max_new_tokens=3)


@pytest.mark.parametrize("name", ["tiny-gemma4-assistant", "tiny-gemma4-dflash"])
def test_enable_on_a_drafter_says_to_pass_it_as_the_assistant(name):
    drafter = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path(name))
    with pytest.raises(TypeError, match=r"A drafter .* is not enabled: pass it to its target's generate as "
                                        r"assistant_model="):
        hf_specdec.enable(drafter)


def test_a_dflash_checkpoint_loaded_by_transformers_auto_class_names_the_loader(gemma):
    """transformers' Auto class builds a DFlash checkpoint's base type (Qwen3) without the drafter's layers: the
    error says to load it with hf_specdec's Auto class, not that no mode fits."""
    import transformers

    from hf_specdec.assets import asset_path, available_assets

    if "tiny-gemma4-dflash" not in available_assets():
        pytest.skip("the bundled DFlash drafter is not installed")
    target, _, _ = gemma
    plain = transformers.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-dflash"), dtype=torch.float32)
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"loaded from a DFlash drafter checkpoint as a plain causal LM.*"
                                         r"hf_specdec\.AutoModelForCausalLM\.from_pretrained"):
        target.generate(ids, attention_mask=mask, assistant_model=plain, max_new_tokens=3)


def test_assistant_for_another_target_width(gemma):
    _, assistant, _ = gemma  # built for hidden_size 256
    narrow = hf_specdec.enable(gemma4_e2b_style(vocab_size=4096, vocab_size_per_layer_input=4096))
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"built for a target with hidden_size 256, but the target has hidden_size 32; "
                                         r"load the assistant built for this target"):
        narrow.generate(ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=3)


def test_assistant_for_another_vocabulary(tmp_path):
    assistant = _random_assistant(tmp_path, gemma4_e2b_style(vocab_size=96, vocab_size_per_layer_input=96))
    target = hf_specdec.enable(gemma4_e2b_style(vocab_size=128, vocab_size_per_layer_input=128))
    ids, mask = _batch(vocab=96)
    with pytest.raises(ValueError, match=r"vocab mismatch: assistant vocab_size 96 != target vocab_size 128; "
                                         r"load the assistant built for this target"):
        target.generate(ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=3)


def test_gemma_assistant_for_a_non_gemma_target(gemma):
    _, assistant, _ = gemma
    target = hf_specdec.enable(llama(vocab_size=4096))
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"needs a Gemma 4 target .* got 'llama'; use a DFlash drafter or plain"):
        target.generate(ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=3)


def test_dflash_drafter_for_another_target_width():
    drafter = _dflash_drafter(gemma4_e2b_style())
    wider = hf_specdec.enable(gemma4_e2b_style(hidden_size=48))
    ids, mask = _batch(vocab=97)
    with pytest.raises(ValueError, match=r"has hidden_size 32 but the target has 48; load the drafter built for this"):
        wider.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=3)


def test_step3p5_checkpoint_without_mtp_weights(tmp_path):
    tiny_step3p5.write_checkpoint(tmp_path / "step", tiny_step3p5.real_config_dict(), with_mtp=False)
    model = hf_specdec.AutoModelForCausalLM.from_pretrained(tmp_path / "step")
    ids, mask = _batch(vocab=64)
    with pytest.raises(ValueError, match=r"has no MTP weights .* Load a checkpoint with MTP layers, or call generate "
                                         r"without spec_mode"):
        model.generate(ids, attention_mask=mask, spec_mode="mtp", max_new_tokens=3)
    assert model.generate(ids, attention_mask=mask, max_new_tokens=3, **GREEDY).shape == (2, 10)  # plain still works


# ---- num_speculative_tokens --------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, -2, 2.5, True])
def test_num_speculative_tokens_must_be_a_positive_integer(gemma, k):
    target, assistant, _ = gemma
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be a positive integer"):
        target.generate(ids, attention_mask=mask, assistant_model=assistant, num_speculative_tokens=k, max_new_tokens=3)


def test_num_assistant_tokens_alias_is_checked_too(step):
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be a positive integer or 'auto', got 0"):
        step.generate(ids, attention_mask=mask, spec_mode="mtp", num_assistant_tokens=0, max_new_tokens=3)


def test_k_given_twice_is_refused(gemma):
    """num_speculative_tokens and its alias num_assistant_tokens both given: refused, naming both (one silently
    won before)."""
    target, assistant, _ = gemma
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"num_speculative_tokens=5 and num_assistant_tokens=2 both set k"):
        target.generate(ids, attention_mask=mask, assistant_model=assistant, num_speculative_tokens=5,
                        num_assistant_tokens=2, max_new_tokens=3)


def test_more_drafts_than_step3p5_has_mtp_layers(step):
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"has 3 MTP layers; pass num_speculative_tokens <= 3"):
        step.generate(ids, attention_mask=mask, spec_mode="mtp", num_speculative_tokens=4, max_new_tokens=3)


def test_more_drafts_than_a_dflash_block_holds():
    target = hf_specdec.enable(gemma4_e2b_style())
    drafter = _dflash_drafter(target, block_size=4)
    ids, mask = _batch(vocab=97)
    with pytest.raises(ValueError, match=r"block_size=4: pass num_speculative_tokens <= 3"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, num_speculative_tokens=4, max_new_tokens=3)


def test_num_speculative_tokens_without_a_drafter_is_not_ignored(step):
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"without a drafter: pass assistant_model=.* or spec_mode='mtp'"):
        step.generate(ids, attention_mask=mask, num_speculative_tokens=3, max_new_tokens=3)


# ---- the batch ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_right_padded_batch(gemma, step, mode):
    model, extra = _mode(gemma, step, mode)
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"needs left-padded batches .* tokenizer.padding_side = 'left'"):
        model.generate(ids, attention_mask=mask.flip(1), max_new_tokens=3, **extra)


@pytest.mark.parametrize("bad_mask", ["narrow", "one_row", "1d"])
def test_attention_mask_of_the_wrong_shape(gemma, bad_mask):
    target, assistant, _ = gemma
    ids, mask = _batch()
    wrong = {"narrow": mask[:, 1:], "one_row": mask[:1], "1d": mask[0]}[bad_mask]
    with pytest.raises(ValueError, match=r"attention_mask has shape .* but input_ids \(2, 7\); pass the 2D mask"):
        target.generate(ids, attention_mask=wrong, max_new_tokens=3, assistant_model=assistant)


@pytest.mark.parametrize("mode", MODES)
def test_an_empty_prompt_row(gemma, step, mode):
    model, extra = _mode(gemma, step, mode)
    ids, mask = _batch()
    mask[1] = 0
    with pytest.raises(ValueError, match=r"row 1 of the batch has no tokens; remove empty prompts"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, **extra)


def test_a_batch_without_any_token(gemma):
    target, _, _ = gemma
    with pytest.raises(ValueError, match=r"input_ids has no tokens; give every prompt at least one token"):
        target.generate(torch.zeros(2, 0, dtype=torch.long), max_new_tokens=3)


@pytest.mark.parametrize("mode", MODES)
def test_max_new_tokens_zero_raises_as_transformers_does(gemma, step, mode):
    """transformers refuses max_new_tokens=0 (it does not return the prompt); so does every mode here."""
    model, extra = _mode(gemma, step, mode)
    _, _, reference = gemma
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be greater than 0") as theirs:
        reference.generate(ids, attention_mask=mask, max_new_tokens=0)
    with pytest.raises(ValueError) as ours:
        model.generate(ids, attention_mask=mask, max_new_tokens=0, **extra)
    assert str(ours.value) == str(theirs.value)


# ---- capacity ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("knob", [dict(max_cache_tokens=64), dict(num_blocks=4)])
@pytest.mark.parametrize("mode", MODES)
def test_a_prompt_longer_than_the_cache_can_hold(gemma, step, mode, knob):
    model, extra = _mode(gemma, step, mode)
    ids, mask = _batch((60, 5))
    saved = model._hf_specdec.cache_config
    hf_specdec.enable(model, hf_specdec.CacheConfig(block_size=16, **knob))
    received = []
    try:
        name = next(iter(knob))
        with pytest.raises(CacheCapacityError, match=rf"CacheConfig.{name}=.* Raise {name}"):
            model.generate(ids, attention_mask=mask, max_new_tokens=8, streamer=_Recorder(received), **extra, **GREEDY)
    finally:
        hf_specdec.enable(model, saved)
    assert received[:1] == [ids.tolist()] and received[1:] == ["end"]  # no generated token was streamed


def test_a_streamer_consumer_is_released_when_generate_fails(gemma):
    """A TextIteratorStreamer read in another thread ends instead of waiting forever."""
    target, _, _ = gemma
    tok = bundled.tokenizer()
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=10)
    saved = target._hf_specdec.cache_config
    hf_specdec.enable(target, hf_specdec.CacheConfig(block_size=16, max_cache_tokens=16))
    ids, mask = _batch()
    try:
        with pytest.raises(CacheCapacityError):
            target.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=8, streamer=streamer)
    finally:
        hf_specdec.enable(target, saved)
    assert "".join(streamer) == ""  # the iteration ends (no token was generated)


# ---- num_return_sequences, beam search, outputs ------------------------------------------------------------
@pytest.mark.parametrize("mode", SPEC_MODES)
def test_num_return_sequences_with_drafts_gives_each_copy_the_right_answer(gemma, step, mode):
    """top_k=1 sampling is deterministic: every returned sequence must be the greedy answer of its prompt."""
    model, extra = _mode(gemma, step, mode)
    ids, mask = _batch()
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=10, **GREEDY)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=1, num_return_sequences=3,
                         eos_token_id=None, pad_token_id=0, **extra)
    assert torch.equal(got, greedy.repeat_interleave(3, dim=0))


def test_num_return_sequences_with_greedy_decoding_is_refused_like_transformers(gemma):
    target, assistant, _ = gemma
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"Greedy methods .* do not support `num_return_sequences`"):
        target.generate(ids, attention_mask=mask, assistant_model=assistant, num_return_sequences=2, max_new_tokens=3,
                        do_sample=False)


@pytest.mark.parametrize("mode", SPEC_MODES)
def test_beam_search_with_drafts_is_refused(gemma, step, mode):
    model, extra = _mode(gemma, step, mode)
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"does not support beam search \(num_beams=3\); drop it, or drop the "
                                         r"assistant_model / spec_mode"):
        model.generate(ids, attention_mask=mask, num_beams=3, max_new_tokens=3, **extra)


def test_beam_search_without_drafts_gives_transformers_answer(step):
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, num_beams=2, max_new_tokens=5, **GREEDY)
    expected = _disabled(step, lambda: step.generate(ids, **kwargs))
    assert torch.equal(step.generate(ids, **kwargs), expected)


_OTHER_METHODS = {  # options that ask transformers for another decoding method, and its name in our errors
    "contrastive search": dict(penalty_alpha=0.6, top_k=4),
    "DoLa decoding": dict(dola_layers="high"),
    "constrained beam search": dict(force_words_ids=[[655]]),
}


@pytest.mark.parametrize("method", list(_OTHER_METHODS))
def test_other_decoding_methods_go_to_transformers_loop_and_are_refused_with_drafts(gemma, step, method):
    """Contrastive search, DoLa and constrained beam search (transformers' generation modes besides greedy and
    sampling) were decoded as plain greedy, silently, because the paged loop took every call with one beam. Plain
    calls now meet transformers' own handling (which asks for trust_remote_code: the methods live on the Hub),
    and calls with a drafter are refused with the fix."""
    target, _, reference = gemma
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=3, **_OTHER_METHODS[method], **GREEDY)
    with pytest.raises(ValueError) as stock:
        reference.generate(ids, **kwargs)
    with pytest.raises(ValueError) as ours:
        target.generate(ids, **kwargs)
    assert str(ours.value) == str(stock.value)
    for mode in SPEC_MODES:
        model, extra = _mode(gemma, step, mode)
        with pytest.raises(ValueError, match=rf"does not support {method} \(.*\); drop it, or drop the "
                                             r"assistant_model / spec_mode"):
            model.generate(ids, **kwargs, **extra)


def test_a_decoding_method_asked_with_the_models_defaults_goes_to_transformers_loop():
    """The method is the one of the config transformers decodes with: a GenerationConfig's unset fields take the model's
    defaults (its top_k of 64 with penalty_alpha is contrastive search, which was decoded as plain greedy)."""
    from transformers import GenerationConfig

    reference, ours = llama(), hf_specdec.enable(llama())
    for model in (reference, ours):
        model.generation_config.top_k = 64
    ids, mask = _batch(vocab=97)
    config = GenerationConfig(penalty_alpha=0.6, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError) as stock:
        reference.generate(ids, attention_mask=mask, generation_config=config)
    with pytest.raises(ValueError) as got:
        ours.generate(ids, attention_mask=mask, generation_config=config)
    assert str(got.value) == str(stock.value)


def test_use_mtp_on_a_model_with_its_own_mtp_layers_drafts_with_them(step):
    """transformers' switch for drafting with a model's own MTP layers (use_mtp=True) runs hf_specdec's MTP mode on
    Step 3.5 (transformers' own loop failed, not finding MTP layers), with plain decoding's tokens."""
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, **GREEDY)
    expected = step.generate(ids, **kwargs)
    assert torch.equal(step.generate(ids, use_mtp=True, **kwargs), expected)
    stats = hf_specdec.last_generation_stats(step)
    assert stats.spec_mode == "mtp" and stats.num_target_forwards < 12


def test_per_step_scores_with_drafts_are_refused_not_dropped(gemma):
    target, assistant, _ = gemma
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"returns sequences only, not output_scores; drop output_scores=True"):
        target.generate(ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=3,
                        return_dict_in_generate=True, output_scores=True)


def _stepwise_options(name: str) -> dict:
    if name == "guidance_scale":
        return dict(guidance_scale=1.5)
    from transformers import SynthIDTextWatermarkingConfig

    return dict(watermarking_config=SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340, 443], ngram_len=3))


@pytest.mark.parametrize("option", ["guidance_scale", "watermarking_config"])
@pytest.mark.parametrize("mode", SPEC_MODES)
def test_processors_with_state_across_steps_are_refused_with_drafts_before_anything_runs(gemma, step, mode, option,
                                                                                         monkeypatch):
    """guidance_scale's processor runs the model on an unconditional prompt step by step with a cache of its own, and
    SynthID's watermark keeps the tokens it has seen: a round's several positions (and rejected drafts) would corrupt
    them (a batch of 3 crashed, a batch of 1 gave other tokens). Refused with the fix; plain decoding keeps them."""
    from hf_specdec.generation.speculative import SpeculativeLoop

    model, extra, reference = bundled.mode(mode)
    ids, mask = _batch()
    options = _stepwise_options(option)
    monkeypatch.setattr(SpeculativeLoop, "__init__", lambda *a, **k: pytest.fail("the loop started"))
    with pytest.raises(ValueError, match=rf"{option}.* keeps state from one decoding step to the next .* "
                                         rf"Drop {option}, or drop the assistant_model / spec_mode"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, **options, **GREEDY, **extra)
    monkeypatch.undo()
    plain = dict(attention_mask=mask, max_new_tokens=3, **options, **GREEDY)
    assert torch.equal(model.generate(ids, **plain), reference.generate(ids, **plain))


def test_hidden_states_of_plain_decoding_come_from_transformers_loop(gemma):
    target, _, reference = gemma
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True, output_hidden_states=True,
                  **GREEDY)
    got, expected = target.generate(ids, **kwargs), reference.generate(ids, **kwargs)
    assert got.hidden_states is not None and len(got.hidden_states) == len(expected.hidden_states)
    for mine, theirs in zip(got.hidden_states, expected.hidden_states):
        torch.testing.assert_close(mine[-1], theirs[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("with_ids", [False, True])
def test_inputs_embeds_go_to_transformers_loop_and_are_refused_with_drafts(gemma, with_ids):
    """The paged prefill reads token ids: inputs_embeds (alone, or beside input_ids, where transformers prefills
    from the embeddings) decode through transformers' loop, with its tokens; with a drafter they are refused."""
    target, assistant, reference = gemma
    ids = torch.tensor([[2, 5, 6, 7]])
    embeds = target.get_input_embeddings()(ids).detach()
    kwargs = dict(inputs_embeds=embeds, max_new_tokens=5, **GREEDY, **(dict(input_ids=ids) if with_ids else {}))
    assert torch.equal(target.generate(**kwargs), reference.generate(**kwargs))
    with pytest.raises(ValueError, match=r"does not support inputs_embeds; drop it, or drop the assistant_model"):
        target.generate(assistant_model=assistant, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_a_call_without_a_prompt_starts_from_bos_as_transformers_does(gemma, step, mode):
    """No input_ids (the text-generation pipeline's empty prompt without special tokens): transformers starts the
    row from the BOS token; so does every mode (drafted calls were refused), with transformers' greedy tokens."""
    model, extra = _mode(gemma, step, mode)
    kwargs = dict(max_new_tokens=8, do_sample=False)
    expected = _disabled(model, lambda: model.generate(**kwargs))
    got = model.generate(**kwargs, **extra)
    assert torch.equal(got, expected) and got[0, 0] == model.generation_config.bos_token_id
    assert hf_specdec.last_generation_stats(model) is not None  # the paged loop ran it


def _with_model_defaults(model, **defaults):
    """Set ``model.generation_config`` fields; returns a function that puts the old values back."""
    old = {name: getattr(model.generation_config, name) for name in defaults}
    for name, value in defaults.items():
        setattr(model.generation_config, name, value)
    return lambda: [setattr(model.generation_config, n, v) for n, v in old.items()]


def test_a_passed_generation_config_takes_the_models_defaults_for_what_it_leaves_unset(gemma, step):
    """transformers fills a passed GenerationConfig's unset fields from model.generation_config, so a default there
    (per-step scores or attentions, sampling, use_mtp) counts as if asked in the call: refused with drafts, sent to
    transformers' loop, sampled with the drafter's fixed k (a seed repeats its tokens), drafted with Step 3.5's own
    MTP layers."""
    from transformers import GenerationConfig

    target, assistant, reference = gemma
    ids, mask = _batch()
    passed = GenerationConfig(max_new_tokens=6)
    restore = _with_model_defaults(target, return_dict_in_generate=True, output_scores=True)
    try:
        with pytest.raises(ValueError, match=r"returns sequences only, not output_scores"):
            target.generate(ids, attention_mask=mask, generation_config=passed, assistant_model=assistant)
    finally:
        restore()
    restore = [_with_model_defaults(m, return_dict_in_generate=True, output_attentions=True)
               for m in (target, reference)]
    try:
        got = target.generate(ids, attention_mask=mask, generation_config=passed)
        expected = reference.generate(ids, attention_mask=mask, generation_config=passed)
        assert got.attentions is not None and len(got.attentions) == len(expected.attentions)
    finally:
        [r() for r in restore]
    restore = _with_model_defaults(target, do_sample=True)
    try:
        runs = []
        for _ in range(2):
            torch.manual_seed(0)
            runs.append(target.generate(ids, attention_mask=mask, assistant_model=assistant,
                                        generation_config=GenerationConfig(max_new_tokens=30)))
            assert hf_specdec.last_generation_stats(target).num_speculative_tokens == 4  # the MTP default, not "auto"
        assert torch.equal(runs[0], runs[1])
    finally:
        restore()
    restore = _with_model_defaults(step, use_mtp=True)
    try:
        step.generate(ids, attention_mask=mask, generation_config=GenerationConfig(max_new_tokens=8, do_sample=False))
        assert hf_specdec.last_generation_stats(step).spec_mode == "mtp"
    finally:
        restore()


def test_stop_strings_in_the_models_generation_config(gemma):
    """stop_strings set as a model default (with tokenizer= in the call) stop where transformers stops, with or
    without a passed GenerationConfig, plain and drafted (they raised: transformers found no tokenizer)."""
    from transformers import GenerationConfig

    target, assistant, reference = gemma
    tok = bundled.tokenizer()
    ids, mask = bundled.batch(1)
    free = reference.generate(ids, attention_mask=mask, max_new_tokens=24, **GREEDY)
    stop = tok.decode(free[0, ids.shape[1] + 8:ids.shape[1] + 10])
    restore = [_with_model_defaults(m, stop_strings=[stop]) for m in (target, reference)]
    try:
        kwargs = dict(attention_mask=mask, max_new_tokens=24, tokenizer=tok, **GREEDY)
        expected = reference.generate(ids, **kwargs)
        assert expected.shape[1] < free.shape[1]
        for extra in ({}, dict(assistant_model=assistant), dict(generation_config=GenerationConfig(max_new_tokens=24))):
            assert torch.equal(target.generate(ids, **kwargs, **extra), expected), extra
    finally:
        [r() for r in restore]


# ---- where the assistant lives -----------------------------------------------------------------------------
def test_assistant_in_another_dtype(gemma):
    target, assistant, _ = gemma
    ids, mask = _batch()
    half = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-assistant"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"assistant_model is in torch.bfloat16 but the target in torch.float32; .*"
                                         r"assistant_model.to\(torch.float32\)"):
        target.generate(ids, attention_mask=mask, assistant_model=half, max_new_tokens=3)
    assert half.dtype == torch.bfloat16  # refused, not silently converted


def test_assistant_on_another_device(gemma):
    target, _, _ = gemma
    ids, mask = _batch()
    elsewhere = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-assistant"),
                                                                dtype=torch.float32).to("meta")
    with pytest.raises(ValueError, match=r"assistant_model is on meta but the target on cpu; move it first: "
                                         r"assistant_model.to\('cpu'\)"):
        target.generate(ids, attention_mask=mask, assistant_model=elsewhere, max_new_tokens=3)


# ---- threads -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", SPEC_MODES)
def test_concurrent_generate_calls_are_serialised(gemma, step, mode):
    model, extra = _mode(gemma, step, mode)
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, **GREEDY, **extra)
    expected = model.generate(ids, **kwargs)
    results = [None] * 3

    def run(i):
        results[i] = model.generate(ids, **kwargs)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(r is not None and torch.equal(r, expected) for r in results)


def test_generate_from_inside_generate_raises_instead_of_deadlocking(gemma):
    target, assistant, _ = gemma
    ids, mask = _batch()

    class Reentrant:
        error = None

        def put(self, value):
            if self.error is None:
                try:
                    target.generate(ids, attention_mask=mask, max_new_tokens=2)
                except RuntimeError as err:
                    self.error = err

        def end(self):
            pass

    streamer = Reentrant()
    target.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=3, streamer=streamer, assistant_model=assistant)
    assert streamer.error is not None and "from inside a generate call on the same model" in str(streamer.error)


# ---- helpers -----------------------------------------------------------------------------------------------
class _Recorder:
    def __init__(self, into):
        self.into = into

    def put(self, value):
        self.into.append(value.tolist())

    def end(self):
        self.into.append("end")


def _mode(gemma, step, mode):
    """(model, generate kwargs) of a decoding mode."""
    return bundled.mode(mode)[:2]


def _disabled(model, fn):
    """fn() on the model with hf_specdec switched off (then on again)."""
    config = model._hf_specdec.cache_config
    hf_specdec.disable(model)
    try:
        return fn()
    finally:
        hf_specdec.enable(model, config)


@pytest.mark.parametrize("bound", [0, -1, 2.5, True, "8"])
def test_max_cuda_graphs_must_be_a_positive_integer(bound):
    with pytest.raises(ValueError, match="max_cuda_graphs must be an int >= 1"):
        hf_specdec.enable(llama(), max_cuda_graphs=bound)
