"""Token selection from processed scores, exactly as transformers' ``_sample`` does it."""

from __future__ import annotations

import copy
import math

import torch
from transformers import LogitsProcessorList

from hf_specdec.kernels.argmax import argmax
from hf_specdec.runtime import Select

def _greedy_next(input_ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor]:
    return (argmax(logits[:, -1]),)


# greedy decoding without logits processors: each row's next token is the argmax of its last logits, taken with the
# forward (inside its CUDA graph where one replays: no launches from the host for it)
GREEDY_NEXT = Select("greedy_next", _greedy_next)
# False: greedy selection and acceptance after the forward, as with logits processors (read at each call: an A/B knob)
SELECT_WITH_FORWARD = True


def select_tokens(scores: torch.Tensor, do_sample: bool, ranks=None) -> torch.Tensor:
    """scores [batch, vocab] (after logits processors) -> tokens [batch]. ``ranks`` (a tensor-parallel group):
    sampled tokens are rank 0's on every rank."""
    if do_sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return same_on_every_rank(torch.multinomial(probs, num_samples=1).squeeze(1), ranks)
    return argmax(scores)


def same_on_every_rank(tensor: torch.Tensor, ranks) -> torch.Tensor:
    """``tensor``, with the values of rank 0 of the tensor-parallel group ``ranks`` on every rank (as it is when
    ``ranks`` is None): what one rank drew at random, every rank then feeds to the sharded model."""
    return tensor if ranks is None else ranks.broadcast(tensor)


def mask_finished(tokens: torch.Tensor, unfinished: torch.Tensor, pad_token_id: torch.Tensor | None) -> torch.Tensor:
    """Rows that already stopped emit the pad token, like transformers."""
    if pad_token_id is None:
        raise ValueError(
            "generation stops at EOS but no pad_token_id is set; pass pad_token_id= to generate "
            "(for example the tokenizer's pad or eos id)."
        )
    return tokens * unfinished + pad_token_id * (1 - unfinished)


# Processors whose output depends on the scores alone (never on input_ids): they can be applied to every
# verified position of every row in one batched call.
_HISTORY_FREE = (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "TopHLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "SuppressTokensLogitsProcessor",
    "InfNanRemoveLogitsProcessor", "LogitNormalization",
)


def _eos_masked_below(processor, lengths: torch.Tensor, scores: torch.Tensor, shortest: int) -> torch.Tensor:
    """``scores`` [n, vocab] with the processor's EOS ids at -inf in the rows whose ``lengths`` are below
    ``shortest``: what ``processor(ids, scores[i:i+1])`` does for ids of ``lengths[i]`` tokens."""
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    eos = torch.isin(vocab, processor.eos_token_id.to(scores.device))
    return torch.where((lengths < shortest)[:, None] & eos[None, :], -math.inf, scores)


# Processors whose output depends on the scores and the number of ids only (not on the ids themselves):
# name -> f(processor, lengths [n], scores [n, vocab]), the whole batch of positions in one call.
_LENGTH_ONLY = {
    "MinLengthLogitsProcessor": lambda p, lengths, scores: _eos_masked_below(p, lengths, scores, p.min_length),
    "MinNewTokensLengthLogitsProcessor": lambda p, lengths, scores: _eos_masked_below(
        p, lengths - p.prompt_length_to_skip, scores, p.min_new_tokens),
}

# Processors that generate() builds with state for the whole batch, or that read a row's index in it; the scorer
# calls them one row at a time, each through a view of that row: name -> f(processor, row, batch), the processor as
# it would score row ``row`` of the request's ``batch`` rows (after num_return_sequences repeated the prompts),
# called on that row alone (:data:`_ROW_VIEWS`, below)


def _padding_row(processor, row: int, batch: int):
    """The repetition penalty's per-row prompt padding (``prompt_ignore_length``, one per repeated row) of ``row``."""
    ignore = processor.prompt_ignore_length
    if not (isinstance(ignore, torch.Tensor) and ignore.dim() >= 1 and ignore.shape[0] == batch):
        return processor  # an int, or none: the same for every row
    view = copy.copy(processor)
    view.prompt_ignore_length = ignore[row:row + 1]
    return view


def _encoder_ids_row(processor, row: int, batch: int):
    """The encoder repetition penalty, built on the unrepeated prompts' ids, narrowed to the prompt of ``row``."""
    ids = processor.encoder_input_ids
    view = copy.copy(processor)
    source = row // max(1, batch // ids.shape[0])
    view.encoder_input_ids = ids[source:source + 1]
    return view


def _encoder_ngrams_row(processor, row: int, batch: int):
    """The encoder n-gram ban, built on the unrepeated prompts' n-grams, narrowed to the prompt of ``row``."""
    view = copy.copy(processor)
    source = row // max(1, batch // processor.batch_size)
    view.batch_size, view.generated_ngrams = 1, [processor.generated_ngrams[source]]
    return view


def _prefix_row(processor, row: int, batch: int):
    """``prefix_allowed_tokens_fn`` called with the batch id of ``row`` (rows of a prompt's ``num_return_sequences``
    repeats share it, as transformers' processor counts them) while the processor sees that row alone."""
    view, allowed, repeats = copy.copy(processor), processor._prefix_allowed_tokens_fn, processor._num_beams
    view._num_beams = 1
    view._prefix_allowed_tokens_fn = lambda batch_id, ids: allowed(row // repeats, ids)
    return view


_ROW_VIEWS = {
    "RepetitionPenaltyLogitsProcessor": _padding_row,
    "PrefixConstrainedLogitsProcessor": _prefix_row,
    "EncoderRepetitionPenaltyLogitsProcessor": _encoder_ids_row,
    "EncoderNoRepeatNGramLogitsProcessor": _encoder_ngrams_row,
}


def is_transformers_own(obj) -> bool:
    """Whether ``obj`` is an instance of a class of transformers' (a processor or criterion it builds, or one of its
    public ones a user passes), whose per-row behaviour this module knows; a class defined elsewhere may do
    anything with a row's index."""
    return type(obj).__module__.split(".")[0] == "transformers"


class AtRow:
    """A processor or stopping criterion of the user's, called for row ``row`` of the request's ``batch`` rows as
    generate's loop would call it: with a batch of ``batch`` rows, every one of them showing that row's ids and
    scores (a processor or criterion may treat each index of its batch its own way, e.g. ban other tokens in each
    row), and that row's index read back. A speculative round scores and stops rows one position at a time, and rows
    whose lengths differ could not share one call."""

    def __init__(self, fn, row: int, batch: int):
        self.fn, self.row, self.batch = fn, row, batch

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None):  # (two arguments: LogitsProcessorList)
        ids = input_ids.expand(self.batch, -1).clone()
        scores = None if scores is None else scores.expand(self.batch, -1).clone()  # (written in place, often)
        return self.fn(ids, scores)[self.row:self.row + 1]


# Processors that keep state from one decoding step to the next (their own forward and cache over the step's ids):
# a speculative round scores several positions of a row at once, and rejected drafts would have advanced that state.
# name -> the generate option that adds it
_STEPWISE = {"UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
             "SynthIDTextWatermarkLogitsProcessor": "watermarking_config (SynthID Text)"}


def check_speculative_processors(logits_processor) -> None:
    """Refuse, before anything runs, the processors a speculative round cannot score (:data:`_STEPWISE`)."""
    for processor in logits_processor or ():
        option = _STEPWISE.get(type(processor).__name__)
        if option is not None:
            raise ValueError(
                f"{option} keeps state from one decoding step to the next (CFG: its own forward and cache over an "
                f"unconditional prompt; SynthID: the tokens it has seen), while a speculative round scores several "
                f"positions at once and may reject some: they cannot be combined. Drop {option.split(' ')[0]}, or "
                f"drop the assistant_model / spec_mode to use it with plain decoding.")


class PositionScorer:
    """Applies a LogitsProcessorList to several positions of rows of different lengths.

    ``score(prefixes, logits)``: ``logits [batch, positions, vocab]`` (float32) where position ``j`` of row ``b``
    predicts the token after ``prefixes[b] + extra[b][:j]``; the processors see exactly the ids that plain
    decoding would have shown them. When every processor is history-free or reads only the number of ids
    (``min_length``, ``min_new_tokens``), they run on all positions of all rows in one batched call each.
    """

    def __init__(self, logits_processor, batch: int | None = None):
        """``batch``: the rows of the request, for processors with per-row state (their index in it); rows that
        leave the batch are told with :meth:`keep_rows`."""
        self.processors = logits_processor
        known = [type(p).__name__ if is_transformers_own(p) else None for p in logits_processor]
        self.history_free = all(name in _HISTORY_FREE for name in known)
        self.batched = all(name in _HISTORY_FREE or name in _LENGTH_ONLY for name in known)
        self._row_views: dict[int, LogitsProcessorList] = {}
        self.batch = batch
        self.order: list[int] | None = None  # each scored row's index in the request (None: the same)

    def keep_rows(self, rows: list[int]) -> None:
        """Rows ``rows`` of the scored batch (indices into it, in that order) are the batch from now on: row ``i``
        after is row ``rows[i]`` before (the loop dropped the others)."""
        order = self.order if self.order is not None else range(self.batch)
        self.order = [order[b] for b in rows]

    def score(self, prefixes: list[torch.Tensor], extra: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """prefixes: per row [len_b] token ids; extra [batch, >= positions-1] tokens after the prefix."""
        batch, positions, vocab = logits.shape
        if not self.processors:
            return logits
        if self.batched:
            return self._score_batched(prefixes, extra, logits)
        out = torch.empty_like(logits)
        for b in range(batch):
            processors = self._row_view(b if self.order is None else self.order[b], self.batch or batch)
            for j in range(positions):
                ids = torch.cat([prefixes[b], extra[b, :j]])[None, :]
                out[b, j] = processors(ids, logits[b, j][None, :].clone())[0]
        return out

    def _score_batched(self, prefixes: list[torch.Tensor], extra: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """All positions of all rows at once, the processors in their order; a history-free processor is shown
        placeholder ids, a length-only one the number of ids each position's row would have."""
        batch, positions, vocab = logits.shape
        scores, dummy, lengths = logits.reshape(-1, vocab), None, None
        for processor in self.processors:
            by_length = _LENGTH_ONLY.get(type(processor).__name__)
            if by_length is not None:
                if lengths is None:  # host-known lengths: no device sync (nor the ids' copy, given `lengths()`)
                    known = prefixes.lengths() if hasattr(prefixes, "lengths") else [len(p) for p in prefixes]
                    lengths = torch.tensor(known, device=logits.device)[:, None]
                    lengths = (lengths + torch.arange(positions, device=logits.device)).reshape(-1)
                scores = by_length(processor, lengths, scores)
            else:
                dummy = extra.new_zeros(batch * positions, 1) if dummy is None else dummy
                scores = processor(dummy, scores)
        return scores.reshape(batch, positions, vocab)

    def _row_view(self, row: int, batch: int) -> LogitsProcessorList:
        """The processors as seen by row ``row`` of the request's ``batch`` rows, called on it alone: per-row state
        built by ``generate`` for the whole batch (e.g. the repetition penalty's per-row prompt padding) is narrowed
        to that row, a processor that reads the row's index (``prefix_allowed_tokens_fn``) is told it, and a processor
        of the user's is called at that index of a batch of the request's size (:class:`AtRow`)."""
        if row not in self._row_views:
            view = LogitsProcessorList()
            for processor in self.processors:
                narrow = _ROW_VIEWS.get(type(processor).__name__) if is_transformers_own(processor) else None
                if narrow is not None:
                    processor = narrow(processor, row, batch)
                elif batch > 1 and not is_transformers_own(processor):
                    processor = AtRow(processor, row, batch)
                view.append(processor)
            self._row_views[row] = view
        return self._row_views[row]
