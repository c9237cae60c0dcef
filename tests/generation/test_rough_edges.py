"""What users hit first: each case gives transformers' behaviour or a clear error that names the fix."""

import copy
import threading

import pytest
import torch
from transformers import StoppingCriteria

import hf_specdec
from tests import bundled

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("mode", bundled.MODES)
def test_an_empty_batch_names_the_fix(mode):
    model, extra, _ = bundled.mode(mode)
    with pytest.raises(ValueError, match="input_ids has no rows .* pass at least one prompt"):
        model.generate(input_ids=torch.zeros(0, 5, dtype=torch.long), max_new_tokens=3, **GREEDY, **extra)


def test_enable_takes_a_dict_of_cache_fields_and_names_bad_ones():
    model, _, _ = bundled.mode("plain")
    saved = model._hf_specdec.cache_config
    try:
        hf_specdec.enable(model, {"block_size": 8})
        assert model._hf_specdec.cache_config == hf_specdec.CacheConfig(block_size=8)
        ids, mask = bundled.batch(2)
        model.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
        with pytest.raises(TypeError, match=r"unknown CacheConfig field\(s\) \['blocksize'\]"):
            hf_specdec.enable(model, {"blocksize": 8})
        with pytest.raises(TypeError, match="pass hf_specdec.CacheConfig"):
            hf_specdec.enable(model, 8)
    finally:
        hf_specdec.enable(model, saved)


@pytest.mark.parametrize("mode", ["plain", "gemma_mtp"])
def test_a_deep_copy_of_an_enabled_model_decodes_on_its_own(mode):
    model, extra, _ = bundled.mode(mode)
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, **GREEDY, **extra)
    twin = copy.deepcopy(model)
    assert twin._hf_specdec is not model._hf_specdec and twin._hf_specdec.lock is not model._hf_specdec.lock
    assert twin.generate.__self__ is twin
    assert torch.equal(twin.generate(ids, **kwargs), model.generate(ids, **kwargs))
    hf_specdec.disable(twin)
    assert hasattr(model, "_hf_specdec")


class StopOnTokenSeeingScores(StoppingCriteria):
    """Stops a row on ``token`` and records the scores it is handed."""

    def __init__(self, token):
        self.token, self.seen = token, []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(scores)
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("mode", bundled.MODES)
def test_a_stopping_criterion_gets_the_scores_transformers_loop_hands_it(mode):
    """transformers' loop hands a criterion None where the scores are not kept (a speculative call keeps none):
    drafted rounds too, stopping where transformers' loop stops."""
    model, extra, reference = bundled.mode(mode)
    ids, _ = bundled.batch(1)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, **GREEDY)
    free = reference.generate(ids, **kwargs)[0, ids.shape[1]:]
    token = free[10].item()
    expected = reference.generate(ids, stopping_criteria=[StopOnTokenSeeingScores(token)], **kwargs)
    criterion = StopOnTokenSeeingScores(token)
    got = model.generate(ids, stopping_criteria=[criterion], **kwargs, **extra)
    assert torch.equal(got, expected) and got.shape[1] <= ids.shape[1] + 11
    assert criterion.seen and all(s is None for s in criterion.seen)


@pytest.mark.parametrize("mode", ["plain", "gemma_mtp"])
def test_disable_from_another_thread_waits_for_the_running_call(mode, monkeypatch):
    """disable() from another thread while generate runs: the call finishes with the undisturbed tokens, then
    the model is disabled."""
    model, extra, _ = bundled.mode(mode)
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, **GREEDY, **extra)
    expected = model.generate(ids, **kwargs)
    started, result = threading.Event(), {}

    class Signal:
        def put(self, value):
            started.set()

        def end(self):
            pass

    def run():
        result["out"] = model.generate(ids, streamer=Signal(), **kwargs)

    worker = threading.Thread(target=run)
    try:
        worker.start()
        assert started.wait(30)
        hf_specdec.disable(model)
        worker.join()
        assert torch.equal(result["out"], expected) and not hasattr(model, "_hf_specdec")
    finally:
        worker.join()
        hf_specdec.enable(model)


def test_set_attn_implementation_after_enable_is_refused_until_enable_again():
    model, _, _ = bundled.mode("plain")
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, **GREEDY)
    expected = model.generate(ids, **kwargs)
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(ValueError, match=r"attention was set to 'sdpa' after hf_specdec.enable.*"
                                             r"hf_specdec.enable\(model\) again"):
            model.generate(ids, **kwargs)
    finally:
        hf_specdec.enable(model)
    assert torch.equal(model.generate(ids, **kwargs), expected)


def test_disable_keeps_an_attention_the_user_set_after_enable():
    """The refusal above says ``hf_specdec.disable(model)`` generates with the attention the user set: disable keeps
    it (it restored the one of enable's time), and restores that one where hf_specdec's is still set."""
    from tests.tiny_models import llama

    model = llama()
    model.set_attn_implementation("sdpa")
    hf_specdec.enable(model).set_attn_implementation("eager")
    hf_specdec.disable(model)
    assert model.config._attn_implementation == "eager"  # (was "sdpa")
    hf_specdec.disable(hf_specdec.enable(model))
    assert model.config._attn_implementation == "eager"


def test_an_enabled_model_is_not_pickled_half_enabled():
    """``torch.save(model)`` of an enabled model raises, naming what to do (pickle would look its generate and fused
    forwards up again by name on the loaded model, and find transformers' own); disabled, it pickles, and enabled
    again after loading it decodes as before."""
    import io

    from tests.tiny_models import llama

    model = hf_specdec.enable(llama())
    ids = torch.tensor([[3, 14, 15, 92]])
    expected = model.generate(ids, max_new_tokens=6, **GREEDY)
    with pytest.raises(TypeError, match=r"cannot be pickled .* hf_specdec.disable\(model\) before saving it and "
                                        r"hf_specdec.enable\(model\) after loading it, or .*save_pretrained"):
        torch.save(model, io.BytesIO())
    buffer = io.BytesIO()
    torch.save(hf_specdec.disable(model), buffer)
    buffer.seek(0)
    loaded = hf_specdec.enable(torch.load(buffer, weights_only=False))
    assert torch.equal(loaded.generate(ids, max_new_tokens=6, **GREEDY), expected)


def test_stats_of_a_call_that_transformers_loop_ran_are_none_not_the_last_calls():
    model, extra, _ = bundled.mode("gemma_mtp")
    ids, mask = bundled.batch(2)
    model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY, **extra)
    assert hf_specdec.last_generation_stats(model) is not None
    model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=2, **GREEDY)
    assert hf_specdec.last_generation_stats(model) is None


@pytest.mark.parametrize("name,mode", [("tiny-gemma4-assistant", "gemma_mtp"), ("tiny-gemma4-dflash", "gemma_dflash")])
def test_a_drafter_loads_with_the_targets_attention_kwarg(name, mode):
    """A drafter loaded with its target's kwargs (attn_implementation="sdpa") loads, as with "eager" (transformers
    refused it: its attention is hf_specdec's own, whatever that kwarg says), and drafts as the drafter does."""
    from hf_specdec.assets import asset_path, available_assets

    if name not in available_assets():
        pytest.skip(f"{name} is not bundled")
    model, extra, _ = bundled.mode(mode)
    drafter = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path(name), attn_implementation="sdpa")
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, **GREEDY)
    assert torch.equal(model.generate(ids, **kwargs, **dict(extra, assistant_model=drafter)),
                       model.generate(ids, **kwargs, **extra))


def test_a_target_loaded_with_its_loading_info_is_enabled():
    """``output_loading_info=True`` gives (model, info), as transformers does, with the model enabled (it came back
    as transformers' own: plain calls decoded without hf_specdec and drafted ones were refused)."""
    from hf_specdec.assets import asset_path

    model, info = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"), output_loading_info=True)
    assert hasattr(model, "_hf_specdec") and not info["missing_keys"]
    ids, mask = bundled.batch(1)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    assert hf_specdec.last_generation_stats(model).num_generated_tokens == 4


def test_the_bundled_family_loads_in_float32_on_cpu_unless_a_dtype_is_given():
    """Stored in bf16; float32 by default on CPU, where greedy speculative output is plain greedy's exactly."""
    from hf_specdec.assets import asset_path

    target = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"))
    assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-assistant"))
    drafter = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-dflash"))
    assert {next(m.parameters()).dtype for m in (target, assistant, drafter)} == {torch.float32}
    as_stored = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"), dtype=torch.bfloat16)
    assert next(as_stored.parameters()).dtype == torch.bfloat16
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, **GREEDY)
    plain = target.generate(ids, **kwargs)
    assert torch.equal(target.generate(ids, assistant_model=assistant, **kwargs), plain)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), plain)


def test_enable_from_inside_a_generate_call_raises_instead_of_waiting_for_itself():
    model, _, _ = bundled.mode("plain")
    ids, mask = bundled.batch(1)
    errors = []

    class Reenable:
        def put(self, value):
            if not errors:
                try:
                    hf_specdec.enable(model, cuda_graphs=False)
                except RuntimeError as error:
                    errors.append(error)

        def end(self):
            pass

    model.generate(ids, attention_mask=mask, max_new_tokens=3, streamer=Reenable(), **GREEDY)
    assert errors and "hf_specdec.enable(model) was called from inside a generate call" in str(errors[0])
