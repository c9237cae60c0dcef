"""The shared speculative loop with toy drafters: greedy losslessness (invariant 1), rollback through the
loop, stopping inside an accepted chunk, and the sampled distribution (invariant 4)."""

import pytest
import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import hf_specdec
from tests.distribution import assert_follows, second_token_marginal
from tests.generation.toy_drafters import CopyDrafter
from tests.tiny_models import chi_square_pair, gemma4_31b_style, gemma4_e2b_style, left_padded_batch, llama

MODELS = {"gemma4_e2b": gemma4_e2b_style, "gemma4_31b": gemma4_31b_style, "llama": llama}


@pytest.mark.parametrize("name,k", [("gemma4_e2b", 3), ("gemma4_31b", 8), ("llama", 1), ("gemma4_e2b", 1)])
def test_greedy_speculative_equals_plain_greedy(name, k):
    ref, ours = MODELS[name](), hf_specdec.enable(MODELS[name]())
    ids, mask = left_padded_batch([12, 3, 9, 6])
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = ref.generate(ids, **kwargs)
    drafter = CopyDrafter(MODELS[name](), k, noise=0.35)
    got = ours.generate(ids, assistant_model=drafter, **kwargs)
    assert torch.equal(got, expected)
    stats = hf_specdec.last_generation_stats(ours)
    assert stats.num_generated_tokens == 20 * 4
    assert 1.0 < stats.mean_accepted_length < k + 1  # some drafts accepted, some rejected
    hist = stats.acceptance_histogram
    assert sum(i * c for i, c in enumerate(hist)) == stats.num_accepted_tokens
    # each row-step commits its accepted drafts + 1; the last step of a row may be cut at max_new_tokens
    assert stats.num_generated_tokens <= stats.num_accepted_tokens + sum(hist) + 4


def test_perfect_drafts_give_tau_of_k_plus_one():
    ref = llama()
    ours = hf_specdec.enable(llama())
    ids, mask = left_padded_batch([5, 8])
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=17, do_sample=False, eos_token_id=None,
                        assistant_model=CopyDrafter(llama(), 3))
    assert torch.equal(got, ref.generate(ids, attention_mask=mask, max_new_tokens=17, do_sample=False,
                                         eos_token_id=None))
    stats = hf_specdec.last_generation_stats(ours)
    assert stats.num_target_forwards == 1 + 4  # prefill gives 1 token, then 4 steps of 4 tokens
    assert stats.acceptance_histogram == [0, 0, 0, 8]


def test_eos_inside_an_accepted_chunk_cuts_the_row_like_plain_decoding():
    ref, ours = gemma4_e2b_style(), hf_specdec.enable(gemma4_e2b_style())
    ids, mask = left_padded_batch([6, 9, 4])
    free = ref.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=None)
    eos = [int(free[0, 11]), int(free[2, 15])]
    kwargs = dict(attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = ref.generate(ids, **kwargs)
    got = ours.generate(ids, assistant_model=CopyDrafter(gemma4_e2b_style(), 4), **kwargs)
    assert torch.equal(got, expected)


def test_sampled_tokens_follow_the_target_distribution():
    """Invariant 4: the 2nd and 3rd generated tokens (decided by rejection sampling over drafts from a
    different distribution) have the target's exact marginals (chi-square over many independent rows)."""
    target, other = chi_square_pair()
    ours = hf_specdec.enable(target)
    rows = 3000
    prompt = torch.tensor([[3, 5, 2, 7]])
    torch.manual_seed(0)
    out = ours.generate(prompt.expand(rows, 4), attention_mask=torch.ones(rows, 4, dtype=torch.long),
                        max_new_tokens=3, do_sample=True, eos_token_id=None, pad_token_id=0,
                        assistant_model=CopyDrafter(other, 2))
    assert_follows(out[:, 5], second_token_marginal(target, prompt, 8))
    assert hf_specdec.last_generation_stats(ours).num_accepted_tokens > 0


def test_seeded_speculative_sampling_is_deterministic():
    ours = hf_specdec.enable(gemma4_e2b_style())
    ids, mask = left_padded_batch([6, 9, 4, 7])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=0.7, top_k=20,
                  eos_token_id=None)
    torch.manual_seed(11)
    first = ours.generate(ids, assistant_model=CopyDrafter(gemma4_e2b_style(), 3), **kwargs)
    torch.manual_seed(11)
    second = ours.generate(ids, assistant_model=CopyDrafter(gemma4_e2b_style(), 3), **kwargs)
    assert torch.equal(first, second)


def test_wrong_speculative_arguments_raise():
    ours = hf_specdec.enable(llama())
    ids, mask = left_padded_batch([4])
    with pytest.raises(ValueError, match="spec_mode"):
        ours.generate(ids, attention_mask=mask, spec_mode="medusa", max_new_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ours.generate(ids, attention_mask=mask, spec_mode="mtp", num_speculative_tokens=0, max_new_tokens=2)
    with pytest.raises(ValueError, match="no speculative mode fits"):
        ours.generate(ids, attention_mask=mask, assistant_model=torch.nn.Linear(2, 2), max_new_tokens=2)


def test_history_processors_in_a_batch_match_plain_and_reach_the_drafts():
    """Batched speculative greedy with a repetition penalty (per-row prompt padding state, built by generate
    for the whole batch) and n-gram blocking equals HF; drafts from an exact copy of the target are scored
    by the same processors, so every draft is accepted."""
    ref, ours = llama(), hf_specdec.enable(llama())
    ids, mask = left_padded_batch([7, 3, 10, 5])
    kwargs = dict(attention_mask=mask, max_new_tokens=13, do_sample=False, eos_token_id=None,
                  repetition_penalty=1.8, no_repeat_ngram_size=2)
    expected = ref.generate(ids, **kwargs)
    got = ours.generate(ids, assistant_model=CopyDrafter(llama(), 3), **kwargs)
    assert torch.equal(got, expected)
    stats = hf_specdec.last_generation_stats(ours)
    assert stats.acceptance_histogram[:3] == [0, 0, 0]


def test_processors_that_read_a_rows_index_or_its_prompt_match_plain():
    """Processors that generate builds for the whole batch and that the scorer calls one row at a time: the encoder
    repetition penalty and n-gram ban (the prompts' ids) and prefix_allowed_tokens_fn (the row's batch id) see their
    own row's; greedy equals HF, and sampled rows of num_return_sequences keep their prompt's constraint."""
    ref, ours = llama(), hf_specdec.enable(llama())
    ids, mask = left_padded_batch([7, 3, 10, 5])
    asked = set()

    def allowed(batch_id, prefix):  # row b may emit the tokens = b (mod 4) only
        asked.add(batch_id)
        return list(range(3 + batch_id, 97, 4))

    for extra in (dict(encoder_repetition_penalty=1.8), dict(encoder_no_repeat_ngram_size=2),
                  dict(prefix_allowed_tokens_fn=allowed)):
        kwargs = dict(attention_mask=mask, max_new_tokens=9, do_sample=False, eos_token_id=None, **extra)
        expected = ref.generate(ids, **kwargs)
        asked.clear()
        got = ours.generate(ids, assistant_model=CopyDrafter(llama(), 3, noise=0.35), **kwargs)
        assert torch.equal(got, expected), list(extra)
    assert asked == {0, 1, 2, 3}
    # sampled, each prompt twice: transformers numbers the batch ids as its version does (5.24: one per prompt, 5.17:
    # one per row), and each row keeps the constraint of the id it is asked about
    sampled = dict(attention_mask=mask, max_new_tokens=9, do_sample=True, num_return_sequences=2, eos_token_id=None,
                   prefix_allowed_tokens_fn=allowed)
    asked.clear()
    ref.generate(ids, **sampled)
    repeats = 8 // len(asked)
    torch.manual_seed(0)
    asked.clear()
    got = ours.generate(ids, **sampled, assistant_model=CopyDrafter(llama(), 3, noise=0.35))
    new = got[:, ids.shape[1]:]
    assert got.shape[0] == 8 and asked == set(range(8 // repeats))
    assert all(set(new[r].tolist()) <= set(allowed(r // repeats, None)) for r in range(8))


class BanPerRow(LogitsProcessor):
    """A processor of the user's that treats each index of its batch its own way (row b may not emit its bans)."""

    def __init__(self, bans):
        self.bans = bans

    def __call__(self, input_ids, scores):
        for row, banned in enumerate(self.bans):
            scores[row, banned] = -float("inf")
        return scores


class StopPerRow(StoppingCriteria):
    """A criterion of the user's that treats each index of its batch its own way (row b stops on its own token)."""

    def __init__(self, tokens):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.tokens.to(input_ids.device)


def test_a_users_processor_and_criterion_see_each_row_at_its_own_index():
    """A speculative round scores and stops rows one at a time; a processor or criterion of the user's is called with
    a batch of the request's size whose rows show that row (its index read back): they were called with that row
    alone, as if it were row 0, and rows 1 and up got row 0's bans and stop token. Greedy equals HF's."""
    ref, ours = llama(), hf_specdec.enable(llama())
    ids, mask = left_padded_batch([7, 3, 10])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    free = ref.generate(ids, **kwargs)[:, ids.shape[1]:]
    bans = [[], free[1, 1:3].tolist(), free[2, 1:3].tolist()]  # each row's next tokens, banned in that row only
    expected = ref.generate(ids, logits_processor=LogitsProcessorList([BanPerRow(bans)]), **kwargs)
    got = ours.generate(ids, logits_processor=LogitsProcessorList([BanPerRow(bans)]), **kwargs,
                        assistant_model=CopyDrafter(llama(), 3, noise=0.35))
    assert torch.equal(got, expected)
    assert not torch.equal(expected[:, ids.shape[1]:], free)
    stops = [free[0, 5].item(), free[1, 2].item(), free[2, 8].item()]  # each row stops at another step
    expected = ref.generate(ids, stopping_criteria=StoppingCriteriaList([StopPerRow(stops)]), pad_token_id=0,
                            **kwargs)
    got = ours.generate(ids, stopping_criteria=StoppingCriteriaList([StopPerRow(stops)]), pad_token_id=0, **kwargs,
                        assistant_model=CopyDrafter(llama(), 3, noise=0.35))
    assert torch.equal(got, expected) and expected.shape[1] == ids.shape[1] + 9  # (the last row's stop)


def test_min_length_processors_in_a_batch_match_plain_and_reach_the_drafts():
    """min_length / min_new_tokens keep EOS out of the first tokens of each row: batched speculative greedy
    (rows of different prompt lengths, EOS the token plain decoding would emit early) equals HF, and the
    drafts from an exact copy of the target see the same ban, so every draft is accepted."""
    ref, ours = gemma4_e2b_style(), hf_specdec.enable(gemma4_e2b_style())
    ids, mask = left_padded_batch([6, 9, 4])
    free = ref.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=None)
    eos = [int(free[0, 10]), int(free[2, 12])]
    # min_new_tokens=2 ends the ban just where row 0's EOS comes (its 2nd new token): off by one, the rows differ
    for extra in (dict(min_new_tokens=2), dict(min_new_tokens=6), dict(min_length=ids.shape[1] + 5),
                  dict(min_new_tokens=3, temperature=0.5)):
        kwargs = dict(attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=eos, pad_token_id=0,
                      **extra)
        expected = ref.generate(ids, **kwargs)
        got = ours.generate(ids, assistant_model=CopyDrafter(gemma4_e2b_style(), 4), **kwargs)
        assert torch.equal(got, expected), extra
        assert hf_specdec.last_generation_stats(ours).acceptance_histogram[:4] == [0, 0, 0, 0]


def test_length_only_processors_are_scored_in_one_batched_call():
    """The scorer applies min_length / min_new_tokens to all positions of all rows at once (no per-row loop),
    exactly as each position's own call with its row's ids would, in the processors' order."""
    from transformers import LogitsProcessorList, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    from hf_specdec.generation.sampling import PositionScorer

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=gen)
    prefixes = [torch.randint(40, (n,), generator=gen) for n in (4, 7, 9)]
    extra = torch.randint(40, (3, 5), generator=gen)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), MinLengthLogitsProcessor(8, [3, 11]),
                                      TopKLogitsWarper(6), MinNewTokensLengthLogitsProcessor(5, 5, 17)])
    if hasattr(transformers, "TopHLogitsWarper"):  # (a row's scores alone, too)
        processors.append(transformers.TopHLogitsWarper(0.4))
    scorer = PositionScorer(processors)
    assert scorer.batched and not scorer.history_free
    expected = torch.stack([torch.stack([processors(torch.cat([prefixes[b], extra[b, :j]])[None], logits[b, j][None])[0]
                                         for j in range(5)]) for b in range(3)])
    got = scorer.score(prefixes, extra, logits)
    assert torch.equal(got, expected)
    alone = PositionScorer(LogitsProcessorList([MinLengthLogitsProcessor(8, [3, 11])])).score(prefixes, extra, logits)
    assert torch.isinf(alone[0, :4, 3]).all() and torch.isfinite(alone[0, 4:, 3]).all()  # 4 + j ids reach 8 at j=4
    assert torch.isfinite(alone[2, :, 11]).all() and torch.isfinite(alone[:, :, :3]).all()


def test_graph_replays_are_keyed_by_what_the_drafter_hooks_record(monkeypatch):
    """A CUDA graph of the target's forward replays the records its capture-time hooks made; a drafter whose
    hooks record something else (another holder, other target layers) must not get those graphs, even
    behind a wrapper (a timing drafter) or with a benchmark's acceptance."""
    from benchmarks.drafters import SyntheticAcceptance, TimedDrafter
    from hf_specdec.runtime import ModelRunner
    from hf_specdec.generation.registry import build_drafter
    from tests import bundled

    target, assistant, _ = bundled.gemma()
    signatures = []
    original = ModelRunner.record_hooks_of
    monkeypatch.setattr(ModelRunner, "record_hooks_of",
                        lambda self, holder, signature=None: (signatures.append(signature),
                                                              original(self, holder, signature))[1])
    ids = torch.tensor([[2, 5, 9, 11]])
    for inner in (build_drafter(target, assistant, "mtp", 2), build_drafter(target, bundled.dflash(), "dflash", 2)):
        target.generate(ids, max_new_tokens=3, do_sample=False, assistant_model=TimedDrafter(inner),
                        acceptance=SyntheticAcceptance(0.5))
    mtp, dflash = signatures
    assert mtp != dflash
    assert not hf_specdec.last_generation_stats(target).lossless


def test_row_prefixes_reach_the_device_only_when_read(monkeypatch):
    """The loop hands drafters and processors each row's ids lazily: never read, RowIds.extend never runs
    (greedy MTP without processors); read, they hold everything the rows emitted so far."""
    from hf_specdec.generation.speculative import LazyPrefixes, RowIds

    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    row_ids = RowIds(ids, capacity=10)
    rows = [ids[0].tolist(), ids[1].tolist()]
    calls = []
    monkeypatch.setattr(RowIds, "extend", lambda self, r, _orig=RowIds.extend: calls.append(1) or _orig(self, r))
    LazyPrefixes(row_ids, rows)  # a step that reads nothing
    rows[0] += [11, 12]
    rows[1] += [13]
    assert not calls
    assert LazyPrefixes(row_ids, rows).lengths() == [5, 4] and not calls  # what min_length reads: no copy
    prefixes = LazyPrefixes(row_ids, rows)
    rows[1] += [14]  # emitted before the step reads them
    assert len(prefixes) == 2
    assert [p.tolist() for p in prefixes] == [[0, 5, 6, 11, 12], [7, 8, 9, 13, 14]]
    assert prefixes[1].tolist() == [7, 8, 9, 13, 14] and len(calls) == 1


def test_a_block_of_draft_logits_is_selected_as_position_by_position():
    """select_block (a block drafter's k positions from one forward) gives what select gives position by
    position: the same greedy tokens with and without processors (a repetition penalty sees each draft's
    prefix), and when sampling with history-free processors the same q at every position, tokens from it."""
    from transformers import LogitsProcessorList, MinLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    from hf_specdec.generation.drafter import DraftSelector
    from hf_specdec.generation.sampling import PositionScorer

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=gen)
    logits[:, 1:, 7] = logits.amax() + 0.5  # positions 1.. prefer token 7, which a penalty pushes down once drafted
    prefixes = [torch.randint(40, (n,), generator=gen) for n in (4, 6, 2)]

    def by_position(selector):
        drafted, probs = torch.zeros(3, 0, dtype=torch.long), []
        for j in range(5):
            token, q = selector.select(logits[:, j], drafted)
            drafted, probs = torch.cat([drafted, token[:, None]], dim=1), probs + [q]
        return drafted, probs

    for processors in ([], [TemperatureLogitsWarper(0.7)], [RepetitionPenaltyLogitsProcessor(50.0)],
                       [MinLengthLogitsProcessor(7, 7)]):
        selector = DraftSelector(False, PositionScorer(LogitsProcessorList(processors)), 40, prefixes)
        tokens, q = selector.select_block(logits)
        assert q is None and torch.equal(tokens, by_position(selector)[0])
    penalised = DraftSelector(False, PositionScorer(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(50.0)])),
                              40, prefixes).select_block(logits)[0]
    assert not (penalised[:, 2:] == 7).all()  # the penalty saw the drafts before each position
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    selector = DraftSelector(True, PositionScorer(warpers), 40, prefixes, torch.Generator().manual_seed(1))
    tokens, q = selector.select_block(logits)
    _, expected = by_position(selector)
    assert tokens.shape == (3, 5) and torch.allclose(q, torch.stack(expected, dim=1))
    assert (q.gather(-1, tokens[..., None]) > 0).all() and ((q > 0).sum(-1) == 5).all()  # from the top-5 support


def test_greedy_acceptance_is_taken_with_the_verify_forward_and_a_custom_one_after_it(monkeypatch):
    """Greedy calls without processors accept with the verify forward (in its CUDA graph on the GPU); sampled calls
    and an acceptance that decides otherwise (its own __call__) accept after it. Greedy output is plain greedy's
    both ways."""
    from hf_specdec.generation.acceptance import GreedyAcceptance
    from tests.generation.test_plain_generate import record_selects

    selects = record_selects(monkeypatch)
    target = hf_specdec.enable(llama())
    ids, mask = left_padded_batch([9, 4])
    kwargs = dict(attention_mask=mask, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    expected = target.generate(ids, do_sample=False, **kwargs)

    class Counted(GreedyAcceptance):
        calls = 0

        def __call__(self, draft_tokens, draft_probs, scores):
            Counted.calls += 1
            return super().__call__(draft_tokens, draft_probs, scores)

    for acceptance, taken_with in ((None, GreedyAcceptance().with_forward), (Counted(), None)):
        selects.clear()
        got = target.generate(ids, do_sample=False, assistant_model=CopyDrafter(llama(), 3, noise=0.3),
                              acceptance=acceptance, **kwargs)
        assert torch.equal(got, expected)
        verifies = selects[1:]  # after the prefill
        assert verifies and all(s is taken_with for s in verifies)
    assert taken_with is None and Counted.calls == len(verifies)
    assert GreedyAcceptance().with_forward is not None
    selects.clear()
    torch.manual_seed(0)
    target.generate(ids, do_sample=True, assistant_model=CopyDrafter(llama(), 3, noise=0.3), **kwargs)
    assert selects and all(s is None for s in selects)
