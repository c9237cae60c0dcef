"""Streaming and stopping in every mode, on the bundled tiny family (real acceptance, so accepted chunks hold
several tokens): streamers receive exactly the returned sequence's new tokens, in order, in multi-token
chunks; stop strings and custom stopping criteria cut inside an accepted chunk, giving transformers' plain
answer with no overshoot, in the returned ids and in the stream. (test_user_side.py covers the same with
toy drafters and pipelines.)"""

import threading

import pytest
import torch
from transformers import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer, TextStreamer

from hf_specdec.assets import available_assets
from tests import bundled

MODES = ["plain", "gemma_mtp", "step_plain", "step_mtp", "gemma_dflash"]
SPEC_MODES = ["gemma_mtp", "step_mtp", "gemma_dflash"]
NEW_TOKENS = 32


class Recorder:
    """A streamer that keeps what it is given: the prompt first, then one list per put, then "end"."""

    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.chunks.append("end")

    @property
    def new_tokens(self) -> list[int]:
        return [t for chunk in self.chunks[1:-1] for t in chunk]


def _prompt(row: int = 0):
    enc = bundled.tokenizer()([bundled.prompts(row + 1, 100)[row]], return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _trained_drafter(mode: str) -> bool:
    return mode != "gemma_dflash" or "tiny-gemma4-dflash" in available_assets()


class Tee:
    """Hands every put/end to several streamers, so one generate call feeds them all."""

    def __init__(self, *streamers):
        self.streamers = streamers

    def put(self, value):
        for s in self.streamers:
            s.put(value)

    def end(self):
        for s in self.streamers:
            s.end()


@pytest.mark.parametrize("mode", MODES)
def test_streamers_receive_exactly_the_returned_new_tokens(mode, capsys):
    """A recorder, a TextStreamer printing to stdout and a TextIteratorStreamer read from another thread."""
    model, extra, _ = bundled.mode(mode)
    tok = bundled.tokenizer()
    ids, mask = _prompt()
    recorder, iterator = Recorder(), TextIteratorStreamer(tok, skip_prompt=True, timeout=30)
    result = {}

    def run():
        result["out"] = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                       streamer=Tee(recorder, TextStreamer(tok, skip_prompt=True), iterator), **extra)

    capsys.readouterr()
    worker = threading.Thread(target=run)
    worker.start()
    received = "".join(iterator)
    worker.join()
    new = result["out"][0, ids.shape[1]:].tolist()
    assert recorder.chunks[0] == ids[0].tolist() and recorder.chunks[-1] == "end"
    assert recorder.new_tokens == new
    if mode in SPEC_MODES and _trained_drafter(mode):
        assert max(len(c) for c in recorder.chunks[1:-1]) > 1  # accepted drafts arrive together
    assert received == tok.decode(new)
    assert capsys.readouterr().out == tok.decode(new) + "\n"


@pytest.mark.parametrize("mode", SPEC_MODES)
def test_stop_strings_cut_inside_an_accepted_chunk(mode):
    model, extra, reference = bundled.mode(mode)
    tok = bundled.tokenizer()
    ids, mask = _prompt()
    free, stop_at = _free_run_and_a_stop_inside_a_chunk(model, extra, ids, mask, mode)
    stop = tok.decode(free[stop_at: stop_at + 1])
    assert stop.strip() and stop not in tok.decode(free[:stop_at])
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, stop_strings=[stop], tokenizer=tok)
    expected = reference.generate(ids, **kwargs)
    assert expected.shape[1] == ids.shape[1] + stop_at + 1  # transformers stops on that very token
    recorder = Recorder()
    got = model.generate(ids, streamer=recorder, **kwargs, **extra)
    assert torch.equal(got, expected)
    assert recorder.new_tokens == free[: stop_at + 1]  # nothing past the stop reached the stream


class StopOnToken(StoppingCriteria):
    """Stops a row when it emits ``token``: a per-row criterion transformers does not know about."""

    def __init__(self, token: int):
        self.token = token
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("mode", ["plain"] + SPEC_MODES)
def test_custom_stopping_criteria_cut_inside_an_accepted_chunk_row_by_row(mode):
    """Two rows: the first stops on a token inside an accepted chunk; the other row goes on untouched."""
    model, extra, reference = bundled.mode(mode)
    ids, mask = _prompt()
    free, stop_at = _free_run_and_a_stop_inside_a_chunk(model, extra, ids, mask, mode)
    token = free[stop_at]
    tok = bundled.tokenizer()
    tok.padding_side = "left"
    enc = tok([tok.decode(ids[0]), bundled.prompts(2, 100)[1]], return_tensors="pt", padding=True,
              add_special_tokens=False)
    kwargs = dict(attention_mask=enc["attention_mask"], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    expected = reference.generate(enc["input_ids"], stopping_criteria=[StopOnToken(token)], **kwargs)
    criterion = StopOnToken(token)
    got = model.generate(enc["input_ids"], stopping_criteria=[criterion], **kwargs, **extra)
    assert torch.equal(got, expected)
    width = enc["input_ids"].shape[1]
    assert got[0, width:].tolist()[: stop_at + 1] == free[: stop_at + 1] and got[0, width + stop_at] == token
    assert criterion.calls > 0


class Puts:
    """A streamer that keeps each put's shape and values, as a batch streamer written for generate's loop reads them."""

    def __init__(self):
        self.puts = []

    def put(self, value):
        self.puts.append((tuple(value.shape), value.tolist()))

    def end(self):
        self.puts.append("end")


@pytest.mark.parametrize("mode", SPEC_MODES)
def test_a_batch_streams_one_token_of_each_row_a_step_like_transformers(mode):
    """Several rows stream what generate's loop streams: the prompt, then per step a [batch] tensor of each row's
    token (the pad token once a row stopped at EOS). Rows accept different counts a round; each row's chunk was put
    alone, with no way to tell which row it was, and a streamer reading [batch] tensors failed."""
    model, extra, reference = bundled.mode(mode)
    ids, mask = bundled.batch(3)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    free = reference.generate(ids, **kwargs)[:, ids.shape[1]:]
    kwargs["eos_token_id"] = [free[0, 9].item(), free[2, 20].item()]  # rows stop at other steps
    expected, got = Puts(), Puts()
    out = reference.generate(ids, streamer=expected, **kwargs)
    assert torch.equal(model.generate(ids, streamer=got, **kwargs, **extra), out)
    assert got.puts == expected.puts and expected.puts[1][0] == (3,) and len(expected.puts) > 10


@pytest.mark.parametrize("shorter", [True, False])
@pytest.mark.parametrize("mode", ["plain"] + SPEC_MODES)
def test_a_users_max_length_criterion_sets_the_calls_length(mode, shorter):
    """A MaxLengthCriteria passed in stopping_criteria takes the place of the one generate builds from max_new_tokens
    (transformers' merge), and its loop stops there, sooner or later: speculative calls ran to max_new_tokens, and
    plain calls stopped there when the criterion's length was past it."""
    model, extra, reference = bundled.mode(mode)
    ids, mask = bundled.batch(2)
    length = ids.shape[1] + (5 if shorter else 28)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = reference.generate(ids, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(length)]), **kwargs)
    got = model.generate(ids, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(length)]), **kwargs, **extra)
    assert expected.shape[1] == length and torch.equal(got, expected)


def _free_run_and_a_stop_inside_a_chunk(model, extra, ids, mask, mode):
    """(new tokens of an unstopped greedy run, index t of a new token that first appears strictly inside an
    accepted chunk of that run, i.e. not its chunk's last token; any t > 0 in plain mode)."""
    recorder = Recorder()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=recorder,
                         **extra)
    free = out[0, ids.shape[1]:].tolist()
    tok = bundled.tokenizer()
    offset, candidates = 0, []
    for chunk in recorder.chunks[1:-1]:
        inside = range(len(chunk) - 1) if mode in SPEC_MODES else range(len(chunk))
        candidates += [offset + j for j in inside if offset + j > 0]
        offset += len(chunk)
    for t in candidates:
        text = tok.decode(free[t: t + 1])
        if free[t] not in free[:t] and len(text.strip()) >= 2 and text not in tok.decode(free[:t]):
            return free, t
    if not _trained_drafter(mode):
        pytest.skip("the random DFlash drafter accepts no drafts; bundle tiny-gemma4-dflash for multi-token chunks")
    raise AssertionError(f"no token inside an accepted chunk to stop on; chunks {recorder.chunks[1:-1]}")


@pytest.mark.parametrize("mode", ["plain"] + SPEC_MODES)
def test_without_an_eos_rows_go_on_past_their_stop_until_the_last_row_stops(mode):
    """Without an EOS, transformers pads no finished row: a row that met its stop string goes on decoding until the
    batch's last row met one, and the call ends there. Every mode gives transformers' tokens."""
    model, extra, ids, kwargs, expected = stop_strings_without_eos(mode)
    assert torch.equal(model.generate(ids, **kwargs, **extra), expected)


def stop_strings_without_eos(mode):
    """(model, generate kwargs of the mode, ids, kwargs, transformers' output) of a batch of three rows without an
    EOS, each with a stop string it meets at another point: rows finish at different steps and some go on."""
    model, extra, reference = bundled.mode(mode)
    tok = bundled.tokenizer()
    ids, mask = bundled.batch(3)
    width = ids.shape[1]
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    free = reference.generate(ids, **kwargs)[:, width:]
    stops = [tok.decode(row[at:at + 2]) for row, at in zip(free.tolist(), (5, 11, 19))]
    kwargs.update(stop_strings=stops, tokenizer=tok)
    expected = reference.generate(ids, **kwargs)
    new = expected[:, width:]
    assert new.shape[1] < NEW_TOKENS and (new != 0).all()  # every row finished, and none was padded
    # some row met a stop string well before the call ended, and went on
    first_stop = [min((len(tok.decode(row[:n])) for n in range(1, len(row) + 1)
                       if any(stop in tok.decode(row[:n]) for stop in stops)), default=None) for row in new.tolist()]
    assert any(end is not None and end < len(tok.decode(row)) - 4 for end, row in zip(first_stop, new.tolist()))
    return model, extra, ids, kwargs, expected
