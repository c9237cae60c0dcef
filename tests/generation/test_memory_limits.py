"""A request that does not fit the cache raises CacheCapacityError and leaves nothing behind: every cache it
built is freed, the last stats stay those of the last successful call, and the next calls of the same model
give the same tokens as before the error (in every mode)."""

import pytest
import torch

import hf_specdec
from hf_specdec.cache import CacheCapacityError, sizing
from tests import bundled

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("mode", bundled.MODES)
def test_a_batch_over_max_cache_tokens_raises_and_the_model_stays_usable(mode, monkeypatch):
    model, extra, _ = bundled.mode(mode)
    small_ids, small_mask = bundled.batch(2, chars=60)
    big_ids, big_mask = bundled.batch(4, chars=160)
    kwargs = dict(max_new_tokens=24, **GREEDY, **extra)
    with bundled.cache_config(model, hf_specdec.CacheConfig(block_size=16, max_cache_tokens=256)):
        before = model.generate(small_ids, attention_mask=small_mask, **kwargs)
        stats = hf_specdec.last_generation_stats(model)
        with bundled.recorded_caches(monkeypatch) as made:
            with pytest.raises(CacheCapacityError, match=r"max_cache_tokens=256. Raise max_cache_tokens"):
                model.generate(big_ids, attention_mask=big_mask, **kwargs)
        assert made == []  # refused before any cache was built
        assert hf_specdec.last_generation_stats(model) is stats
        with bundled.recorded_caches(monkeypatch) as made:
            after = model.generate(small_ids, attention_mask=small_mask, **kwargs)
        assert made and all(c.num_used_blocks == [0] * len(c.num_used_blocks) for c in made)
    assert torch.equal(after, before)


@pytest.mark.parametrize("mode", ["step_mtp", "gemma_dflash"])
def test_a_drafter_cache_that_does_not_fit_frees_the_target_cache(mode, monkeypatch):
    """The target's cache fits the memory budget, the drafter's own cache (allocated after the prefill) does
    not: the error still leaves every block free and the model gives the same tokens afterwards."""
    model, extra, _ = bundled.mode(mode)
    ids, mask = bundled.batch(3)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, **GREEDY, **extra)
    before = model.generate(ids, **kwargs)
    budgets = iter([2**40])  # the first request (the target's cache) fits, every later one gets no memory
    monkeypatch.setattr(sizing, "free_device_memory", lambda device: next(budgets, 0))
    with bundled.recorded_caches(monkeypatch) as made:
        with pytest.raises(CacheCapacityError, match=r"gpu_memory_fraction"):
            model.generate(ids, **kwargs)
    assert len(made) == 1 and made[0].num_used_blocks == [0] * len(made[0].num_used_blocks) and not made[0].seq_ids
    monkeypatch.setattr(sizing, "free_device_memory", lambda device: None)
    assert torch.equal(model.generate(ids, **kwargs), before)


def test_other_rows_of_a_batch_that_fits_are_unchanged_by_its_neighbours():
    """A full pool (num_blocks sized to exactly one batch) decodes each row as it would alone."""
    model, extra, _ = bundled.mode("gemma_mtp")
    ids, mask = bundled.batch(3)
    kwargs = dict(max_new_tokens=16, **GREEDY, **extra)
    alone = [model.generate(ids[b: b + 1, mask[b].argmax():], **kwargs)[0] for b in range(3)]
    needed = -(-(ids.shape[1] + 16 + 5) // 16) + 1
    with bundled.cache_config(model, hf_specdec.CacheConfig(block_size=16, num_blocks=3 * needed)):
        together = model.generate(ids, attention_mask=mask, **kwargs)
        with pytest.raises(CacheCapacityError, match=r"Raise num_blocks"):
            model.generate(ids, attention_mask=mask, **{**kwargs, "max_new_tokens": 64})
    for b in range(3):
        assert together[b, mask[b].argmax():].tolist() == alone[b].tolist()
