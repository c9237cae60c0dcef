"""A greedy call runs one round ahead (on the GPU; here on the CPU, where ``RUN_AHEAD_DEVICES`` lets it): round r+1
is verified at positions the device derived from round r's acceptance before the host read round r. The output is
plain greedy decoding's, token for token, whatever the rows accept and wherever they stop; every block comes back.
The bundled tiny family: rows accept different numbers of drafts, its sliding layers (window 64) slide from the
first round on, and a batch's rows stop at different rounds."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec
from hf_specdec.generation import speculative
from hf_specdec.generation.drafter import Drafter, DraftProposal
from hf_specdec.generation.speculative import SpeculativeLoop
from tests import bundled, tiny_models
from tests.generation.test_streaming_and_stopping import Recorder, stop_strings_without_eos

NEW_TOKENS = 40

# rounds drafted ahead are compared with rounds drafted after the commit, round by round
pytestmark = pytest.mark.usefixtures("cpu_drafts_ahead")


@pytest.fixture
def ahead(monkeypatch):
    """Every round the loop queued before the host read the round before it (the in-flight round's k)."""
    monkeypatch.setattr(speculative, "RUN_AHEAD_DEVICES", ("cuda", "cpu"))
    queued = []
    finish = SpeculativeLoop._finish

    def spy(self, verified, in_flight=None):
        if in_flight is not None:
            queued.append(in_flight.k)
        return finish(self, verified, in_flight)

    monkeypatch.setattr(SpeculativeLoop, "_finish", spy)
    return queued


@pytest.mark.parametrize("mode", ["gemma_mtp", "gemma_dflash", "step_mtp"])
@pytest.mark.parametrize("k", ["fixed", "auto"])
def test_rounds_run_ahead_are_plain_greedy_decoding(mode, k, ahead, monkeypatch):
    model, extra, reference = bundled.mode(mode)
    if k == "auto":
        extra = {**extra, "num_speculative_tokens": "auto"}
    ids, mask = bundled.batch(4)
    # row 2 stops early, the others run to max length
    eos = bundled.fresh_token(reference, ids, mask, row=2, at=3, new_tokens=NEW_TOKENS)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=0)
    with bundled.recorded_caches(monkeypatch) as caches:
        out = model.generate(ids, **kwargs, **extra)
    assert torch.equal(out, reference.generate(ids, **kwargs))
    stats = hf_specdec.last_generation_stats(model)
    # the loop ran ahead: all but the first round (and a round after the rows' last) were queued before the host
    # read the one before; fewer rounds than tokens, so drafts were accepted
    assert len(ahead) >= stats.num_target_forwards - 3 > 0
    assert stats.num_target_forwards < NEW_TOKENS
    assert len(caches) >= 1 and all(sum(c.num_used_blocks) == 0 for c in caches)


@pytest.mark.parametrize("mode", ["gemma_mtp", "gemma_dflash"])
def test_rounds_without_drafts_between_rounds_run_ahead(mode, ahead, monkeypatch):
    """"auto" at k = 0 for some rounds: such a round waits for the round before it (the drafter reads that round's
    verify before the next overwrites it), and the rounds with drafts around it run ahead again."""
    model, extra, reference = bundled.mode(mode)
    ids, mask = bundled.batch(3)
    schedule = iter([3, 3, 3, 0, 0, 3, 3, 3, 3, 0] * 20)  # (DFlash drafts ahead only where k held)

    class Scripted(speculative.AdaptiveK):
        def update(self, accepted, k):
            super().update(accepted, k)
            self.k = next(schedule)

    monkeypatch.setattr(speculative, "AdaptiveK", Scripted)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": "auto"})
    assert torch.equal(out, reference.generate(ids, **kwargs))
    assert 0 not in ahead and len(ahead) >= 4


class _RecordsScores(StoppingCriteria):
    """A user's criterion (never stops; records the scores it was given)."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(scores)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("mode", ["gemma_mtp", "step_mtp"])
def test_sampled_calls_do_not_run_ahead(mode, ahead):
    """Sampled calls wait for each round before the next, as everywhere else."""
    model, extra, reference = bundled.mode(mode)
    ids, mask = bundled.batch(2)
    model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=0, do_sample=True,
                   **extra)
    assert ahead == []


@pytest.mark.parametrize("mode", ["gemma_mtp", "step_mtp"])
def test_a_users_stopping_criterion_runs_ahead(mode, ahead):
    """A user's criterion is handed no scores (none are kept, as in transformers' loop), only the rows' ids: the
    call runs ahead with it, with transformers' tokens."""
    model, extra, reference = bundled.mode(mode)
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    criterion = _RecordsScores()
    got = model.generate(ids, stopping_criteria=StoppingCriteriaList([criterion]), **kwargs, **extra)
    assert torch.equal(got, reference.generate(ids, **kwargs))
    assert ahead and criterion.seen and all(s is None for s in criterion.seen)


def test_stop_strings_run_ahead(ahead):
    """Stop strings read the rows' text only: the call runs ahead and stops inside the chunk, as plain decoding."""
    model, extra, reference = bundled.mode("gemma_mtp")
    ids, mask = bundled.batch(3)
    tok = bundled.tokenizer()
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    free = reference.generate(ids, **kwargs)
    stop = tok.decode(free[1, ids.shape[1] + 9:ids.shape[1] + 12])  # three tokens row 1 makes mid-way
    # an EOS no row makes: with one, transformers pads a row after its stop string (without, it goes on)
    unused = next(t for t in range(1, 100) if not (free == t).any())
    kwargs.update(stop_strings=[stop], tokenizer=tok, eos_token_id=unused)
    out = model.generate(ids, **kwargs, **extra)
    assert torch.equal(out, reference.generate(ids, **kwargs))
    assert ahead and (out[1, -5:] == 0).all()  # row 1 stopped mid-way


def test_running_out_of_blocks_ahead_keeps_the_round_in_flight(ahead, monkeypatch):
    """A round queued ahead that finds no blocks first reads and commits the round in flight: the error holds
    every token the rows generated, a prefix of plain greedy decoding."""
    model, extra, reference = bundled.mode("gemma_mtp")
    ids, mask = bundled.batch(2)
    plan_at = hf_specdec.cache.PagedKVCache.plan_at
    calls = []

    def exhausted(self, start, q_len):
        calls.append(1)
        if len(calls) == 3:
            raise hf_specdec.cache.OutOfBlocksError("test: no blocks")
        return plan_at(self, start, q_len)

    monkeypatch.setattr(hf_specdec.cache.PagedKVCache, "plan_at", exhausted)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(hf_specdec.cache.CacheExhaustedError) as caught:
        model.generate(ids, **kwargs, **extra)
    stats = hf_specdec.last_generation_stats(model)
    partial = caught.value.sequences
    expected = reference.generate(ids, **kwargs)
    for row, full in zip(partial, expected):  # rows padded (pad 0) to the longest one's tokens
        length = int(row.nonzero().max()) + 1
        assert length > ids.shape[1] + 2 and torch.equal(row[:length], full[:length])
    # the rounds before the failing one were all committed: one for the first round and each queued ahead
    assert stats.num_target_forwards == len(ahead) + 1 + 1  # + the prefill's step


class _OracleAhead(Drafter):
    """Drafts each row's plain greedy continuation (``reference``: the left-padded rows plain decoding returns),
    wrong with probability ``noise``, so rows accept random numbers of drafts and roll back the rest. Ahead, it
    finds each row's position on the device only (the verify's first position plus its accepted drafts plus one),
    as a real drafter must."""

    spec_mode = "mtp"
    runs_ahead = True

    def __init__(self, reference, prompt_width: int, prompt_lens: list[int], k: int, noise: float, seed: int):
        self.reference, self.num_speculative_tokens, self.noise = reference, k, noise
        self.pad = torch.tensor([prompt_width - n for n in prompt_lens])  # where each row's position 0 sits
        self.gen = torch.Generator().manual_seed(seed)

    def begin(self, context, captured):
        pass

    def _drafts(self, positions: torch.Tensor) -> torch.Tensor:
        """Drafts after the token at each row's ``positions`` (the row's last token, not in the cache yet)."""
        k = self.num_speculative_tokens
        index = (self.pad + positions)[:, None] + 1 + torch.arange(k)[None, :]
        drafts = self.reference.gather(1, index.clamp(max=self.reference.shape[1] - 1))
        wrong = torch.rand(drafts.shape, generator=self.gen) < self.noise
        return torch.where(wrong, (drafts + 1 + torch.randint(0, 50, drafts.shape, generator=self.gen)) % 97, drafts)

    def propose(self, last_tokens, context, selector):
        return DraftProposal(self._drafts(torch.tensor(context.cache.seq_lens)), None)

    def propose_ahead(self, next_tokens, num_accepted, context, captured, selector):
        return DraftProposal(self._drafts(context.forward_meta.q_pos0.long() + num_accepted + 1), None)

    def commit(self, context, captured, num_accepted, kept):
        pass


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("family", ["mistral", "llama"])
def test_running_ahead_bookkeeping_under_random_acceptance_stops_and_sliding_windows(family, seed, ahead):
    """Random prompt lengths, k, acceptance and an EOS that stops one row early, in blocks of 4, over a model whose
    every layer slides a window of 8 tokens (Mistral-style) or attends to everything (Llama-style: a stopped row
    that kept moving on would take the others' blocks): each round the host's bookkeeping of where the device
    placed the round in flight must equal the device's (the loop raises otherwise), and the output must be plain
    greedy decoding's."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 14, (3,), generator=gen).tolist()
    k = int(torch.randint(1, 5, (1,), generator=gen))
    noise = [0.1, 0.3, 0.6][seed % 3]
    build = getattr(tiny_models, family)
    ref, ours = build(), build()
    hf_specdec.enable(ours, hf_specdec.CacheConfig(block_size=4))
    ids, mask = tiny_models.left_padded_batch(lengths, seed=seed)
    free = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                        pad_token_id=0)
    new = free[:, ids.shape[1]:].tolist()
    stopping, others = new[seed % 3], {t for b, row in enumerate(new) if b != seed % 3 for t in row}
    # a token row seed % 3 emits mid-way, first there and in no other row: that row stops early, the others run on
    eos = next(t for p, t in enumerate(stopping) if p >= 4 and t not in stopping[:p] and t not in others)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = ref.generate(ids, **kwargs)
    drafter = _OracleAhead(free, ids.shape[1], lengths, k, noise, seed)
    longest = [0] * len(lengths)  # each row's longest length in the target's cache over the call
    commit = hf_specdec.cache.PagedKVCache.commit

    def record(cache, new_lens):
        if cache.layout.num_layers == 2 and len(new_lens) == len(longest):
            longest[:] = [max(a, b) for a, b in zip(longest, new_lens)]
        return commit(cache, new_lens)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_specdec.cache.PagedKVCache, "commit", record)
        out = ours.generate(ids, assistant_model=drafter, **kwargs)
    assert torch.equal(out, expected)
    # a row holds at most two rounds past its tokens (the round in flight, and the one queued before its result
    # was read), the row that stopped early too: once the host saw it stop, the device stopped moving it on
    tokens = [n + int((row[ids.shape[1]:] != 0).sum()) for n, row in zip(lengths, out)]
    assert all(most <= n + 2 * (k + 1) for most, n in zip(longest, tokens)), (longest, tokens, k)
    stats = hf_specdec.last_generation_stats(ours)
    assert len(ahead) >= stats.num_target_forwards - 3 > 0
    histogram = stats.acceptance_histogram
    assert sum(1 for count in histogram if count) >= 2  # rows accepted different numbers of drafts


@pytest.mark.parametrize("new_tokens", [1, 2, 3, 9])
def test_short_calls_and_a_streamer_running_ahead(new_tokens, ahead):
    """Calls that end within the first rounds (max length reached in the round queued first, or in the one
    queued ahead), with a streamer: it gets exactly the returned tokens, one round after the device made them."""
    model, extra, reference = bundled.mode("gemma_mtp")
    ids, mask = bundled.batch(2)
    streamer = Recorder()
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(ids[:1], **{**kwargs, "attention_mask": mask[:1]}, streamer=streamer, **extra)
    assert torch.equal(out, reference.generate(ids[:1], **{**kwargs, "attention_mask": mask[:1]}))
    # the prompt first (as transformers does), then each chunk, then the end
    assert streamer.chunks[0] + streamer.new_tokens == out[0].tolist() and streamer.chunks[-1] == "end"
    assert torch.equal(model.generate(ids, **kwargs, **extra), reference.generate(ids, **kwargs))


@pytest.mark.parametrize("mode", ["gemma_mtp", "gemma_dflash"])
def test_rows_going_on_past_their_stop_run_ahead(mode, ahead):
    """Without an EOS a finished row goes on until the batch's last row finishes (as generate does): running ahead,
    the rows the host saw finish keep moving on the device, and the call ends where transformers' does."""
    model, extra, ids, kwargs, expected = stop_strings_without_eos(mode)
    assert torch.equal(model.generate(ids, **kwargs, **extra), expected)
    assert ahead


def test_rounds_without_drafts_that_end_the_drafting_run_ahead(ahead, monkeypatch):
    """Step 3.5 MTP under "auto" whose drafts are never accepted: k falls to 0, which ends the call's drafting (its k
    does not rise again within a call), and from there every round is queued before the host reads the one before,
    as plain decoding does (the drafter needs nothing of them). The output is plain greedy decoding's, a row that
    stops early stops where it would, and every block comes back."""
    from hf_specdec.generation.acceptance import GreedyAcceptance

    class RejectAll(GreedyAcceptance):
        def __call__(self, draft_tokens, draft_probs, scores):
            num_accepted, _ = super().__call__(draft_tokens, draft_probs, scores)
            return num_accepted * 0, scores.argmax(dim=-1)[:, 0]

    from tests.generation.test_adaptive_k import fixed_round_times

    model, extra, _ = bundled.mode("step_mtp")
    fixed_round_times(monkeypatch, model)  # "auto" from its prior and fixed round times, not a loaded machine's
    ids, mask = bundled.batch(3)
    eos = bundled.fresh_token(model, ids, mask, row=1, at=12, new_tokens=NEW_TOKENS)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    with bundled.recorded_caches(monkeypatch) as caches:
        out = model.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": "auto"}, acceptance=RejectAll())
    assert torch.equal(out, expected)
    # most of the call's rounds are rounds without drafts, queued ahead as the rounds with drafts before them
    assert ahead.count(0) >= NEW_TOKENS // 2 and set(ahead) - {0}, ahead
    assert len(caches) >= 2 and all(sum(c.num_used_blocks) == 0 for c in caches)


@pytest.mark.parametrize("k", [1, 3])
def test_step_mtp_drafts_ahead_what_it_drafts_after_the_commit(k, monkeypatch):
    """Step 3.5 MTP drafting ahead (each layer's entries, tokens and states derived on the device from an acceptance
    the host has not read) proposes what it proposes after each commit: the same drafts round after round while every
    row runs (a layer's K/V or inputs gone wrong would change them), the rows accept the same over the whole call
    (rows reach their max length at different rounds), and every block of its caches comes back."""
    from hf_specdec.models.step3p5.mtp_drafter import Step3p5MTPDraftRunner

    model, extra, reference = bundled.mode("step_mtp")
    ids, mask = bundled.batch(4)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    run_round, propose_ahead = Step3p5MTPDraftRunner._run_greedy_round, Step3p5MTPDraftRunner.propose_ahead
    runs = []
    # the reference drafts after each commit: no round queued ahead, no drafts proposed before the host's read
    for devices, ahead in (((), lambda *args: None), (("cuda", "cpu"), propose_ahead)):
        drafts = []

        def spy(self, last_tokens, plans):
            out = run_round(self, last_tokens, plans)
            drafts.append(out.clone())
            return out

        monkeypatch.setattr(speculative, "RUN_AHEAD_DEVICES", devices)
        monkeypatch.setattr(Step3p5MTPDraftRunner, "propose_ahead", ahead)
        monkeypatch.setattr(Step3p5MTPDraftRunner, "_run_greedy_round", spy)
        with bundled.recorded_caches(monkeypatch) as caches:
            out = model.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": k})
        stats = hf_specdec.last_generation_stats(model)
        assert len(caches) == 1 + k and all(sum(c.num_used_blocks) == 0 for c in caches)
        runs.append((out, stats.num_target_forwards, stats.acceptance_histogram, drafts))
    (out, forwards, histogram, drafts), (out_ahead, forwards_ahead, histogram_ahead, drafts_ahead) = runs
    assert torch.equal(out_ahead, out) and torch.equal(out, reference.generate(ids, **kwargs))
    assert (forwards_ahead, histogram_ahead) == (forwards, histogram) and sum(histogram[1:]) > 0
    # after the commit a row that stopped leaves the batch: the rounds before any row stopped
    every_row = [a for a in drafts if len(a) == len(ids)]
    assert len(every_row) >= 5 and all(torch.equal(a, b) for a, b in zip(every_row, drafts_ahead))


@pytest.mark.parametrize("k", [1, 4])
def test_gemma_mtp_drafts_inside_the_verify_what_it_drafts_after_the_commit(k, monkeypatch):
    """Gemma 4 MTP running ahead drafts the next round inside the verify forward (one replay on the GPU for verify,
    acceptance and drafts): its own ahead call never runs, and the drafts are the ones it makes as its own call
    after each commit (a hidden state, position or block table gone wrong would change them): same drafts round
    after round, same acceptance over the call, plain greedy's tokens, every block back."""
    from hf_specdec.models.gemma4.mtp_drafter import Gemma4MTPDraftRunner
    from hf_specdec.runtime import Readback

    model, extra, reference = bundled.mode("gemma_mtp")
    ids, mask = bundled.batch(4)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    originals = Gemma4MTPDraftRunner._drafts_in_verify, Gemma4MTPDraftRunner.propose_ahead, Readback.wait
    runs = []
    # the reference drafts after each commit (nothing queued ahead); then running ahead with the drafts in the verify
    for devices in ((), ("cuda", "cpu")):
        verified, calls = [], {"in_verify": 0, "ahead": 0}

        def counted(name, original):
            def call(self, *args):
                calls[name] += 1
                return original(self, *args)
            return call

        def wait(self, pending):  # each round's result: accepted, next token, first position, the drafts verified
            host = originals[2](self, pending)
            verified.append(host[0][:, 3:].clone())
            return host

        monkeypatch.setattr(speculative, "RUN_AHEAD_DEVICES", devices)
        monkeypatch.setattr(Gemma4MTPDraftRunner, "_drafts_in_verify", counted("in_verify", originals[0]))
        monkeypatch.setattr(Gemma4MTPDraftRunner, "propose_ahead",
                            counted("ahead", originals[1] if devices else lambda *args: None))
        monkeypatch.setattr(Readback, "wait", wait)
        with bundled.recorded_caches(monkeypatch) as caches:
            out = model.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": k})
        stats = hf_specdec.last_generation_stats(model)
        assert all(sum(c.num_used_blocks) == 0 for c in caches)
        runs.append((out, stats.num_target_forwards, stats.acceptance_histogram, verified, calls))
    (out, forwards, histogram, drafts_after, calls), (out_ahead, forwards_ahead, histogram_ahead, drafts_in, calls_in) \
        = runs
    assert calls["in_verify"] == 0 and calls_in["ahead"] == 0 and calls_in["in_verify"] >= 5
    assert torch.equal(out_ahead, out) and torch.equal(out, reference.generate(ids, **kwargs))
    assert (forwards_ahead, histogram_ahead) == (forwards, histogram) and sum(histogram[1:]) > 0
    # after the commit a row that stopped leaves the batch: the rounds before any row stopped
    every_row = [a for a in drafts_after if len(a) == len(ids)]
    assert len(every_row) >= 5 and all(torch.equal(a, b) for a, b in zip(every_row, drafts_in))
