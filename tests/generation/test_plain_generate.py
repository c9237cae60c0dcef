"""Plain decoding through hf_specdec == transformers' own generate (invariants 1 for plain, 2, 5)."""

import threading

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StoppingCriteria

import hf_specdec
from hf_specdec.compat import cache_argument
from tests.tiny_models import (
    gemma4_26b_style,
    gemma4_31b_style,
    gemma4_e2b_style,
    left_padded_batch,
    llama,
    mistral,
    qwen3,
)

MODELS = {"gemma4_e2b": gemma4_e2b_style, "gemma4_31b": gemma4_31b_style, "gemma4_26b": gemma4_26b_style, "llama": llama,
          "qwen3": qwen3, "mistral": mistral}  # mistral: a sliding window on every layer, without layer_types


def _pair(name):
    """The same weights twice: a stock model and an enabled one."""
    ref = MODELS[name]()
    ours = MODELS[name]()
    return ref, hf_specdec.enable(ours)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_transformers_on_a_left_padded_batch(name):
    ref, ours = _pair(name)
    # prompts and generations longer than the sliding window (8) of the Gemma models
    ids, mask = left_padded_batch([13, 4, 9, 1])
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = ref.generate(ids, **kwargs)
    got = ours.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    stats = hf_specdec.last_generation_stats(ours)
    assert stats.num_target_forwards == 24 and stats.num_generated_tokens == 24 * 4
    assert stats.mean_accepted_length == 1.0


@pytest.mark.parametrize("name", ["gemma4_e2b", "gemma4_31b"])
def test_paged_logits_match_dynamic_cache_logits(name):
    """Invariant 2: every step's logits equal transformers' with its own cache (fp32 tolerance)."""
    ref, ours = _pair(name)
    ids, mask = left_padded_batch([11, 3, 7])
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True, output_logits=True)
    expected = ref.generate(ids, **kwargs)
    got = ours.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.logits, expected.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_eos_lists_stop_rows_and_pad_them_like_transformers():
    ref, ours = _pair("gemma4_e2b")
    ids, mask = left_padded_batch([6, 9, 5])
    free_run = ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    # make two tokens that appear in the free run end-of-sequence tokens
    eos = [int(free_run[0, 12]), int(free_run[1, 14])]
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = ref.generate(ids, **kwargs)
    got = ours.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    assert (got[0, 13:] == 0).all()


def test_max_length_and_return_dict_with_scores():
    ref, ours = _pair("llama")
    ids, mask = left_padded_batch([5, 8])
    kwargs = dict(attention_mask=mask, max_length=15, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True, output_scores=True)
    expected = ref.generate(ids, **kwargs)
    got = ours.generate(ids, **kwargs)
    assert got.sequences.shape == (2, 15) and torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == 7
    for mine, theirs in zip(got.scores, expected.scores):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_logits_processors_and_min_new_tokens_apply_like_transformers():
    ref, ours = _pair("gemma4_31b")
    ids, mask = left_padded_batch([7, 10])

    class BanToken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 5] = -float("inf")
            return scores

    free_run = ref.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, eos_token_id=None)
    eos = int(free_run[0, 10])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, repetition_penalty=1.5,
                  min_new_tokens=4, eos_token_id=eos, pad_token_id=0,
                  logits_processor=LogitsProcessorList([BanToken()]))
    assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_custom_stopping_criteria_are_honoured():
    _, ours = _pair("llama")
    ids, mask = left_padded_batch([4, 6])

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 9, dtype=torch.bool)

    out = ours.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None,
                        stopping_criteria=[StopAfter()])
    assert out.shape == (2, 9)


@pytest.mark.parametrize("name", ["gemma4_e2b", "gemma4_26b"])
def test_sampling_is_seeded_and_follows_the_processed_distribution(name):
    """Invariant 5 for plain sampling: the same seed gives the same tokens (transformers' own, so the same
    distribution); top_k=1 sampling is greedy. gemma4_26b: an MoE target."""
    ref, ours = _pair(name)
    ids, mask = left_padded_batch([6, 9, 3, 12])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9,
                  eos_token_id=None)
    torch.manual_seed(7)
    first = ours.generate(ids, **kwargs)
    torch.manual_seed(7)
    second = ours.generate(ids, **kwargs)
    torch.manual_seed(7)
    theirs = ref.generate(ids, **kwargs)
    assert torch.equal(first, second) and torch.equal(first, theirs)
    greedy = ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    top1 = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=1, eos_token_id=None)
    assert torch.equal(top1, greedy)


def test_num_return_sequences_expands_rows():
    ref, ours = _pair("llama")
    ids, mask = left_padded_batch([5, 3])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=2, eos_token_id=None)
    torch.manual_seed(3)
    got = ours.generate(ids, **kwargs)
    torch.manual_seed(3)
    assert got.shape == (4, 11) and torch.equal(got, ref.generate(ids, **kwargs))


def test_beam_search_runs_on_transformers_loop_with_the_original_attention():
    ref, ours = _pair("llama")
    ids, mask = left_padded_batch([5, 7])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False, eos_token_id=None)
    assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_a_user_cache_runs_on_transformers_loop_and_fills_that_cache():
    """A cache the caller passes (``cache=`` from transformers 5.24, ``past_key_values=`` before) is theirs:
    transformers' own loop decodes into it, and the tokens are transformers' tokens."""
    ref, ours = _pair("gemma4_e2b")
    ids, mask = left_padded_batch([9, 6])
    name = cache_argument(ref)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None)
    cache_ref, cache_ours = DynamicCache(config=ref.config), DynamicCache(config=ours.config)
    expected = ref.generate(ids, **kwargs, **{name: cache_ref})
    assert torch.equal(ours.generate(ids, **kwargs, **{name: cache_ours}), expected)
    assert cache_ours.get_seq_length() == cache_ref.get_seq_length() == ids.shape[1] + 4


def test_checkpointed_training_with_a_cache_treats_the_cache_as_transformers_does():
    """Gradient checkpointing with a user cache: the enabled model's fused forwards hand the cache to the
    original forward the way transformers' checkpointing expects it (transformers 5.24 drops a keyword cache
    before the recompute; a positional one would be updated twice), so the cache ends as the stock model's."""
    ref, ours = _pair("gemma4_e2b")
    ids, _ = left_padded_batch([9, 9])
    lengths = []
    for model in (ref, ours):
        model.train()
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()  # (transformers 5.24's name; the old one goes in v6)
        cache = DynamicCache(config=model.config)
        out = model(ids, use_cache=True, **{cache_argument(model): cache})
        out.logits.float().square().mean().backward()
        lengths.append(cache.get_seq_length())
    assert lengths[0] == lengths[1]


def test_plain_forwards_are_unchanged_by_enable():
    ref, ours = _pair("gemma4_e2b")
    ids, mask = left_padded_batch([9, 6])
    torch.testing.assert_close(ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)
    cache_ref, cache_ours = DynamicCache(config=ref.config), DynamicCache(config=ours.config)
    a = ref(ids, attention_mask=mask, **{cache_argument(ref): cache_ref}, use_cache=True).logits
    b = ours(ids, attention_mask=mask, **{cache_argument(ref): cache_ours}, use_cache=True).logits
    torch.testing.assert_close(a, b)
    hf_specdec.disable(ours)
    assert "generate" not in vars(ours) and ours.config._attn_implementation == ref.config._attn_implementation


def test_bad_inputs_raise_errors_that_name_the_fix():
    _, ours = _pair("llama")
    ids, mask = left_padded_batch([5, 3])
    right_padded = mask.flip(1)
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        ours.generate(ids, attention_mask=right_padded, max_new_tokens=3)
    with pytest.raises(ValueError, match="attention_mask"):
        ours.generate(ids, attention_mask=mask[:, 1:], max_new_tokens=3)
    empty = mask.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match="no tokens"):
        ours.generate(ids, attention_mask=empty, max_new_tokens=3)
    with pytest.raises(ValueError, match="max_cache_tokens"):
        hf_specdec.enable(ours, hf_specdec.CacheConfig(block_size=4, max_cache_tokens=16))
        ours.generate(ids, attention_mask=mask, max_new_tokens=30)


def test_unsupported_models_are_rejected_clearly():
    with pytest.raises(TypeError, match="causal LM"):
        hf_specdec.enable(torch.nn.Linear(2, 2))


def test_concurrent_generate_calls_are_serialised():
    ref, ours = _pair("llama")
    ids, mask = left_padded_batch([5, 3])
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = ref.generate(ids, **kwargs)
    results = [None, None]

    def run(i):
        results[i] = ours.generate(ids, **kwargs)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(torch.equal(r, expected) for r in results)


def record_selects(monkeypatch) -> list:
    """The ``select`` of every forward the runner runs from here on."""
    from hf_specdec.runtime import ModelRunner

    selects, forward = [], ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward",
                        lambda self, *args, select=None, **kwargs: (selects.append(select),
                                                                    forward(self, *args, select=select, **kwargs))[1])
    return selects


class _ReadsScores(StoppingCriteria):
    """Never stops; records the scores it is handed (transformers' loop hands a criterion every step's processed
    fp32 scores so far where they are kept, else None)."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(scores)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_greedy_tokens_are_taken_with_the_forward_unless_something_reads_the_scores(monkeypatch):
    """Greedy decoding with nothing that reads the scores takes each row's argmax with the forward (inside its
    CUDA graph on the GPU); asking for scores or a logits processor keeps the argmax after the forward. A stopping
    criterion gets no scores unless they are kept, as in transformers' loop, so it keeps the argmax in the forward.
    Every way gives transformers' tokens."""
    from hf_specdec.generation.sampling import GREEDY_NEXT

    ref, ours = _pair("gemma4_e2b")
    ids, mask = left_padded_batch([7, 3, 5])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = ref.generate(ids, **kwargs)
    selects = record_selects(monkeypatch)
    assert torch.equal(ours.generate(ids, **kwargs), expected)
    assert len(selects) == 12 and all(s is GREEDY_NEXT for s in selects)  # the prefill's, then every step's
    variants = [dict(output_scores=True, return_dict_in_generate=True),
                dict(logits_processor=LogitsProcessorList([_Identity()]))]
    for extra in variants:
        selects.clear()
        out = ours.generate(ids, **kwargs, **extra)
        assert torch.equal(getattr(out, "sequences", out), expected), extra
        assert selects and all(s is None for s in selects), extra
    selects.clear()
    criterion = _ReadsScores()
    assert torch.equal(ours.generate(ids, stopping_criteria=[criterion], **kwargs), expected)
    assert all(s is GREEDY_NEXT for s in selects) and criterion.seen == [None] * 12


def test_stopping_criteria_get_the_scores_transformers_hands_them():
    """transformers' loop hands a stopping criterion the tuple of every step's processed scores so far where
    they are kept (return_dict_in_generate and output_scores), else None; its own ConfidenceCriteria reads
    ``scores[-1]`` of that tuple. A batch of rows, each criterion's view and the tokens equal transformers'."""
    from transformers.generation.stopping_criteria import ConfidenceCriteria

    ref, ours = _pair("gemma4_e2b")
    ids, mask = left_padded_batch([7, 3, 5])
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    for keep in (False, True):
        extra = dict(output_scores=True, return_dict_in_generate=True) if keep else {}
        seen = {}
        for name, model in (("transformers", ref), ("ours", ours)):
            criterion = _ReadsScores()
            model.generate(ids, stopping_criteria=[criterion], **kwargs, **extra)
            seen[name] = criterion.seen
        assert len(seen["ours"]) == len(seen["transformers"]) == 8
        for got, want in zip(seen["ours"], seen["transformers"]):
            if not keep:
                assert got is None and want is None
                continue
            assert isinstance(got, tuple) and len(got) == len(want)
            assert all(torch.allclose(g, w, atol=1e-5) and g.dtype == torch.float32 for g, w in zip(got, want))
    prompt = ids[:1]  # (the longest row: no padding)
    one_row = dict(kwargs, attention_mask=torch.ones_like(prompt), output_scores=True, return_dict_in_generate=True)
    free = ref.generate(prompt, **one_row)
    chosen = [s.softmax(-1)[0, t].item() for s, t in zip(free.scores, free.sequences[0, prompt.shape[1]:])]
    bound = min(chosen[:-1]) * 1.0001  # the least confident step but the last: the criterion stops there or before
    outs = [model.generate(prompt, stopping_criteria=[ConfidenceCriteria(bound)], **one_row).sequences
            for model in (ref, ours)]
    assert torch.equal(outs[1], outs[0]) and outs[0].shape[1] < prompt.shape[1] + 8  # it stopped early


class _Identity(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores
