"""Long runs: generating many windows past the sliding window, and many generate calls on one model, in every
mode. Sliding KV groups stay bounded while the sequence grows, every block goes back to its pool after each
call, and the Python-held tensors do not grow from call to call. (The GPU soak is benchmarks/soak.py.)"""

import gc
import warnings

import pytest
import torch

import hf_specdec
from hf_specdec.cache import PagedKVCache, sizing
from tests.models.gemma4.helpers import assistant_config_dict, random_state_dict, released_layout, write_checkpoint
from tests.models.step3p5.tiny_step3p5 import tiny_model
from tests.tiny_models import gemma4_e2b_style, left_padded_batch

NEW_TOKENS = 48  # 6 sliding windows of the tiny Gemma (8), 9 of the tiny Step 3.5 (5)
BLOCK = 4
MODES = ["plain", "gemma_mtp", "step_plain", "step_mtp", "gemma_dflash"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (enabled model, stock reference, generate kwargs, vocab)."""
    gemma_ref = gemma4_e2b_style(vocab_size=96, vocab_size_per_layer_input=96)
    gemma = hf_specdec.enable(gemma4_e2b_style(vocab_size=96, vocab_size_per_layer_input=96),
                              hf_specdec.CacheConfig(block_size=BLOCK))
    config = assistant_config_dict(gemma.config, True)
    path = write_checkpoint(tmp_path_factory.mktemp("assistant"), config, random_state_dict(released_layout(config)))
    assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(path)
    step_ref, step = tiny_model(), hf_specdec.enable(tiny_model(), hf_specdec.CacheConfig(block_size=BLOCK))
    found = {
        "plain": (gemma, gemma_ref, {}, 96),
        "gemma_mtp": (gemma, gemma_ref, dict(assistant_model=assistant, num_speculative_tokens=3), 96),
        "step_plain": (step, step_ref, {}, 64),
        "step_mtp": (step, step_ref, dict(spec_mode="mtp", num_speculative_tokens=3), 64),
    }
    from tests import bundled

    if bundled.dflash_registered():
        from tests.models.dflash.helpers import random_drafter

        target = hf_specdec.enable(gemma4_e2b_style(), hf_specdec.CacheConfig(block_size=BLOCK))
        found["gemma_dflash"] = (target, gemma4_e2b_style(), dict(assistant_model=random_drafter(target)), 97)
    return found


def _get(models, mode):
    if mode not in models:
        pytest.skip("no DFlash drafter is registered for spec_mode='dflash' yet")
    return models[mode]


@pytest.mark.parametrize("mode", MODES)
def test_far_past_the_window_sliding_groups_stay_bounded_and_blocks_come_back(models, mode, monkeypatch):
    model, reference, extra, vocab = _get(models, mode)
    ids, mask = left_padded_batch([11, 3, 7], vocab=vocab)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    peaks: dict[int, list[int]] = {}  # id(cache) -> peak used blocks per group after a commit
    made = []
    build, commit = sizing.cache_for_request, PagedKVCache.commit

    lookaheads = {}  # id(cache) -> the lookahead it was sized for

    def record_build(*args, **kw):
        made.append(build(*args, **kw))
        lookaheads[id(made[-1])] = args[4]
        return made[-1]

    def record_commit(cache, new_lens):
        commit(cache, new_lens)
        old = peaks.get(id(cache), [0] * len(cache.num_used_blocks))
        peaks[id(cache)] = [max(a, b) for a, b in zip(old, cache.num_used_blocks)]

    monkeypatch.setattr(sizing, "cache_for_request", record_build)
    monkeypatch.setattr(PagedKVCache, "commit", record_commit)
    out = model.generate(ids, **kwargs, **extra)
    assert torch.equal(out, reference.generate(ids, **kwargs))  # lossless many windows past the window
    assert made
    for cache in made:
        assert cache.num_used_blocks == [0] * len(cache.num_used_blocks) and not cache.seq_ids
        for group, peak in zip(cache.layout.groups, peaks[id(cache)]):
            if group.is_sliding:  # about a window per row, however long the rows grew
                assert peak <= 3 * (-(-(group.sliding_window + 2 + lookaheads[id(cache)]) // BLOCK) + 2)
    target_full = [p for g, p in zip(made[0].layout.groups, peaks[id(made[0])]) if not g.is_sliding]
    assert min(target_full) >= 3 * NEW_TOKENS // BLOCK  # while full-attention groups hold every position


def test_many_calls_in_every_mode_hold_no_more_tensors_than_the_first_ones(models):
    """Two warm-up calls per mode (shapes differ from call to call), then three more per mode: afterwards
    Python holds no more tensors than after the warm-up, and a repeated call gives the same tokens."""
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)

    def call(mode, i):
        model, _, extra, vocab = models[mode]
        ids, mask = left_padded_batch([5 + i, 4, 9][: 1 + i % 3], vocab=vocab, seed=i)
        return model.generate(ids, attention_mask=mask, **kwargs, **extra)

    modes = [m for m in MODES if m in models]
    first = {mode: call(mode, 0) for mode in modes}
    [call(mode, 1) for mode in modes]
    baseline = _live_tensors()
    for i in range(2, 5):
        [call(mode, i) for mode in modes]
    assert _live_tensors() <= baseline
    assert all(torch.equal(call(mode, 0), first[mode]) for mode in modes)


def _live_tensors() -> int:
    """Tensors reachable from Python (parameters and buffers included), after a full collection."""
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() touches deprecated module attributes
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))
