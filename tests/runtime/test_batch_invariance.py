"""Batch invariance on the GPU: in bf16, greedy speculative decoding gives plain greedy decoding's tokens and
logits bit for bit, because a verify step computes each of its k+1 queries per row with the reductions, in the
order, of a one-token decode step (skinny GEMMs with one row-tile shape, paged attention with key tiles and
split-KV chunks counted from key 0, per-row norms; FP8 layers quantize each row's activations alone). Random bf16
weights at the Gemma-4-31B and E4B shapes, and the 31B's quantized to FP8, fine-grained and compressed-tensors' (W8A8
on GPUs with FP8 tensor cores: a last-bit difference between a verify row and a decode row would change its codes),
and the 26B-A4B's in bf16 and fine-grained FP8 (its experts W8A8 too: a verify's tokens share expert blocks),
real widths, cut depth, prompts past the sliding windows; the drafts are plain decoding's own tokens with some
replaced, so rounds accept, reject and roll back at varying positions."""

import pytest
import torch
from transformers import LogitsProcessor

import hf_specdec
from hf_specdec.generation.drafter import Drafter, DraftProposal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="batch invariance is a property of the GPU path")

NEW_TOKENS = 40
PROMPT = 600  # past E4B's 512-key sliding window


class OracleDrafter(Drafter):
    """Drafts row b's next tokens from ``reference[b]`` (plain decoding's new tokens), replacing draft j of round
    r when ``(3 r + 5 b + j) % wrong_every == 0``, so acceptance varies by row and round."""

    spec_mode = "mtp"

    def __init__(self, reference: torch.Tensor, k: int, wrong_every: int = 4):
        self.reference = reference
        self.num_speculative_tokens = k
        self.wrong_every = wrong_every

    def begin(self, context, captured):
        self.generated = [1] * self.reference.shape[0]  # the prefill gave each row its first new token
        self.round = 0

    def propose(self, last_tokens, context, selector) -> DraftProposal:
        k = self.num_speculative_tokens
        drafts = torch.full((len(self.generated), k), 3, dtype=torch.long)
        for b, done in enumerate(self.generated):
            ahead = self.reference[b, done:done + k].cpu()
            drafts[b, :ahead.numel()] = ahead
            for j in range(k):
                if (3 * self.round + 5 * b + j) % self.wrong_every == 0:
                    drafts[b, j] = 3 + (drafts[b, j] + 1) % 1000
        self.round += 1
        return DraftProposal(drafts.to(last_tokens.device), None)

    def commit(self, context, captured, num_accepted, kept):
        self.generated = [g + n for g, n in zip(self.generated, kept)]


class RecordScores(LogitsProcessor):
    """Changes nothing; keeps the scores of each row it is handed keyed by the row's last KEY tokens (the tail of its
    prompt and every token so far: unique per row and position, even when random weights repeat a token). Plain
    decoding calls it with the batch at each step, the speculative loop for each row at each position of a verify
    (drafts it rejects too: their keys are not plain decoding's)."""

    KEY = NEW_TOKENS + 40

    def __init__(self):
        self.scores = {}

    def __call__(self, input_ids, scores):
        for ids, row in zip(input_ids, scores):
            self.scores[tuple(ids[-self.KEY:].tolist())] = row.float().cpu()
        return scores


@pytest.fixture(scope="module", params=[("gemma4-31b", 6, "bf16"), ("gemma4-e4b", 12, "bf16"), ("gemma4-31b", 6, "fp8"),
                                        ("gemma4-31b", 6, "compressed-fp8"), ("gemma4-26b-a4b", 4, "bf16"),
                                        ("gemma4-26b-a4b", 4, "fp8")],
                ids=["31b-L6", "e4b-L12", "31b-L6-fp8", "31b-L6-compressed-fp8", "26b-L4", "26b-L4-fp8"])
def target(request):
    from benchmarks.shapes import target_for
    from tests.quantized.helpers import compressed_fp8_model

    shape, layers, weights = request.param
    if weights == "compressed-fp8":  # per-channel weight scales, activations quantized per row
        model = compressed_fp8_model(target_for(shape, layers, "cuda", torch.bfloat16))
    else:
        model = target_for(shape, layers, "cuda", torch.bfloat16, weights)
    model = hf_specdec.enable(model)
    yield model
    hf_specdec.disable(model)
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("batch", [1, 3])
def test_bf16_speculative_greedy_is_plain_greedy_bit_for_bit(target, batch):
    from benchmarks.shapes import random_prompt

    ids = random_prompt(batch, PROMPT, target.config.vocab_size, "cuda", seed=batch)
    mask = torch.ones_like(ids)
    mask[1:, :37] = 0  # left padding on every row but the first
    run = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    plain_scores = RecordScores()
    plain = target.generate(ids, logits_processor=[plain_scores], **run)
    assert torch.equal(target.generate(ids, **run), plain)  # the recording changes nothing
    reference = plain[:, PROMPT:]
    for k in (3, 7):
        spec_scores = RecordScores()
        drafter = OracleDrafter(reference, k)
        spec = target.generate(ids, assistant_model=drafter, logits_processor=[spec_scores], **run)
        stats = hf_specdec.last_generation_stats(target)
        assert 1.3 < stats.mean_accepted_length < k + 1, stats  # drafts accepted and rejected
        differs = (spec != plain).nonzero()
        assert differs.numel() == 0, f"k={k}: first differing (row, position) {differs[0].tolist()}"
        # every position plain decoding scored was scored by a verify too (a row's last verify may run past it)
        assert len(plain_scores.scores) == batch * NEW_TOKENS
        assert plain_scores.scores.keys() <= spec_scores.scores.keys()
        differ = [(step, (spec_scores.scores[key] - row).abs().max().item())
                  for step, (key, row) in enumerate(plain_scores.scores.items())
                  if key in spec_scores.scores and not torch.equal(spec_scores.scores[key], row)]
        assert not differ, f"k={k}: logits differ at {len(differ)} (call, max |diff|): {differ[:6]}"
