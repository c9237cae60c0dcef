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
    monkeypatch.setattr(sizing, "available_host_memory", lambda: next(budgets, 0))
    with bundled.recorded_caches(monkeypatch) as made:
        with pytest.raises(CacheCapacityError, match=r"cpu_memory_fraction"):
            model.generate(ids, **kwargs)
    assert len(made) == 1 and made[0].num_used_blocks == [0] * len(made[0].num_used_blocks) and not made[0].seq_ids
    monkeypatch.setattr(sizing, "available_host_memory", lambda: None)
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


class _StopAfter:
    """A stopping criterion: every row stops once it holds ``n`` new tokens."""

    def __init__(self, prompt_len: int, n: int):
        self.limit = prompt_len + n

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.limit, dtype=torch.bool)


@pytest.mark.parametrize("mode", bundled.MODES)
def test_a_call_that_stops_early_allocates_for_what_it_generated_not_for_max_new_tokens(mode, monkeypatch):
    """max_new_tokens=10_000_000 and a stop after 3 tokens: every cache the call builds holds a few blocks
    (its pool may be large; its storage grows with the rows), and the tokens are those of a short call."""
    model, extra, _ = bundled.mode(mode)
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, stopping_criteria=[_StopAfter(ids.shape[1], 3)], **GREEDY, **extra)
    expected = model.generate(ids, max_new_tokens=3, **{k: v for k, v in kwargs.items() if k != "stopping_criteria"})
    with bundled.recorded_caches(monkeypatch) as made:
        got = model.generate(ids, max_new_tokens=10_000_000, **kwargs)
    assert torch.equal(got, expected)
    assert made and all(k.shape[1] <= 64 for cache in made for k in cache.k_storage)


@pytest.mark.parametrize("mode", bundled.MODES)
def test_a_request_that_outgrows_its_pool_stops_with_the_tokens_so_far(mode, monkeypatch):
    """A memory budget that holds the prompts but not the whole generation: the call stops with
    CacheExhaustedError, whose sequences are the start of what an unbounded call returns; the model decodes
    normally afterwards and no block is left in use."""
    from hf_specdec.cache import CacheExhaustedError

    model, extra, _ = bundled.mode(mode)
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=400, **GREEDY, **extra)
    expected = model.generate(ids, **kwargs)
    monkeypatch.setattr(sizing, "within_budget", _tight_budget(48))
    with bundled.recorded_caches(monkeypatch) as made:
        with pytest.raises(CacheExhaustedError, match=r"ran out of blocks .* \.sequences") as caught:
            model.generate(ids, **kwargs)
    got = caught.value.sequences
    assert ids.shape[1] < got.shape[1] < expected.shape[1]
    assert 0 < hf_specdec.last_generation_stats(model).num_generated_tokens < 2 * 400  # this call's stats
    for row, full in zip(got, expected):  # rows stop at different lengths (a chunk apart); padding 0 after
        length = len(row) - int(((row.flip(0) != 0).cumsum(0) == 0).sum())
        assert length > ids.shape[1] and torch.equal(row[:length], full[:length])
    assert all(cache.num_used_blocks == [0] * len(cache.num_used_blocks) for cache in made)
    monkeypatch.undo()
    assert torch.equal(model.generate(ids, **kwargs), expected)


def _tight_budget(new_tokens: int):
    """A stand-in for the memory budget that holds the prompts and ``new_tokens`` more positions per row."""
    def tight(layout, cache_config, prompt_lens, max_new_tokens, lookahead, dtype, budget, knob=None):
        return sizing.blocks_needed(layout, cache_config, prompt_lens, min(new_tokens, max_new_tokens), lookahead)
    return tight
