"""Step 3.5 MTP speculative decoding: losslessness (1), MTP-layer K/V after partial rejection (3),
the sampled distribution (4), determinism (5), and the errors for checkpoints without MTP layers."""

import pytest
import torch
from transformers import DynamicCache

import hf_specdec
from hf_specdec.runtime import ModelRunner
from hf_specdec.generation.drafter import DraftSelector
from hf_specdec.generation.sampling import PositionScorer
from hf_specdec.models.step3p5.mtp_drafter import Step3p5MTPDraftRunner
from tests.models.step3p5.tiny_step3p5 import tiny_model
from tests.tiny_models import left_padded_batch


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_mtp_equals_plain_greedy(k):
    ref, ours = tiny_model(), hf_specdec.enable(tiny_model())
    ids, mask = left_padded_batch([11, 3, 8, 6], vocab=64)  # window 5: prompts and outputs past it
    kwargs = dict(attention_mask=mask, max_new_tokens=18, do_sample=False, eos_token_id=None)
    expected = ref.generate(ids, **kwargs)
    got = ours.generate(ids, spec_mode="mtp", num_speculative_tokens=k, **kwargs)
    assert torch.equal(got, expected)
    stats = hf_specdec.last_generation_stats(ours)
    assert stats.spec_mode == "mtp" and stats.num_speculative_tokens == k
    assert len(stats.acceptance_histogram) == k + 1


def test_one_token_prompts_roll_back_no_further_than_the_prompt():
    """A prompt of one token leaves MTP layer j >= 2 no entry to keep when the first verify rejects every draft
    (L_old + a - j < 0): the rollback stops at an empty layer, and the output is still plain greedy's."""
    ref, ours = tiny_model(), hf_specdec.enable(tiny_model())
    ids, mask = left_padded_batch([1, 1, 6], vocab=64)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
    got = ours.generate(ids, spec_mode="mtp", num_speculative_tokens=3, **kwargs)
    assert torch.equal(got, ref.generate(ids, **kwargs))
    assert hf_specdec.last_generation_stats(ours).acceptance_histogram[0] > 0  # some verify accepted nothing


def test_mtp_layer_kv_after_a_partial_rejection_equals_a_fresh_run():
    """After a verify that keeps 2 of 4 tokens, each MTP layer's valid K/V equals that of a fresh run of
    the MTP stack over the committed tokens only."""
    model = hf_specdec.enable(tiny_model())
    drafter = Step3p5MTPDraftRunner(model, 3)
    ids, _ = left_padded_batch([9], vocab=64)
    runner = ModelRunner(model, model._hf_specdec.layout, model._hf_specdec.cache_config)
    context = runner.start([9], 12, lookahead=4)
    with drafter.capture(model) as captured:
        runner.forward(ids, [9], keep_logits=1)
        runner.commit([9])
        drafter.begin(context, captured)
        first = torch.tensor([7])
        selector = DraftSelector(False, PositionScorer([]), 64, [torch.cat([ids[0], first])])
        proposal = drafter.propose(first, context, selector)
        verify = torch.cat([first, proposal.tokens[0]])[None]
        verify[0, 2] = 5 if verify[0, 2] != 5 else 6  # the target "accepts" draft 1 only
        runner.forward(verify, [4])
        runner.commit([9 + 2])
        drafter.commit(context, captured, torch.tensor([1]), [2])
        committed = torch.cat([ids[0], verify[0, :2], torch.tensor([verify[0, 2]])])  # t[0..L], L = 11
        fresh = _fresh_mtp_kv(model, committed)
        for j, mtp_cache in enumerate(drafter.caches):
            layer = model.mtp_layer_indices[j]
            k, v, start = mtp_cache.gather(0, layer)
            n = mtp_cache.seq_lens[0]
            assert n == min(9, 9 + 1 - j)  # entries that consumed rejected drafts were rolled back
            torch.testing.assert_close(k, fresh[j][0][0, :, start:n], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, fresh[j][1][0, :, start:n], rtol=1e-4, atol=1e-4)


def _fresh_mtp_kv(model, tokens):
    """Dense K/V of every MTP layer over committed ``tokens`` t[0..L] (entry i of layer j uses t[i+1+j])."""
    hf_specdec.disable(model)
    try:
        cache = DynamicCache()
        hidden = model(tokens[None], past_key_values=cache, output_pre_norm_hidden_states=True).pre_norm_hidden_state
        below, result = hidden, []
        for j in range(model.num_mtp_layers):
            n = len(tokens) - 1 - j
            mtp_cache = DynamicCache()
            out = model.mtp_step(j, tokens[None, 1 + j:], below[:, :n], past_key_values=mtp_cache,
                                 position_ids=torch.arange(n)[None])
            layer = model.mtp_layer_indices[j]
            result.append((mtp_cache.layers[layer].keys, mtp_cache.layers[layer].values))
            below = out.hidden_state
    finally:
        hf_specdec.enable(model)
    return result


def test_sampled_tokens_follow_the_target_distribution():
    target = hf_specdec.enable(tiny_model(vocab_size=16))
    rows, prompt = 3000, torch.tensor([[3, 5, 9, 7]])
    torch.manual_seed(0)
    out = target.generate(prompt.expand(rows, 4), attention_mask=torch.ones(rows, 4, dtype=torch.long),
                          spec_mode="mtp", num_speculative_tokens=2, max_new_tokens=2, do_sample=True,
                          eos_token_id=None, pad_token_id=0)
    hf_specdec.disable(target)
    with torch.no_grad():
        p1 = torch.softmax(target(prompt).logits[0, -1], -1)
        seconds = torch.stack([torch.softmax(target(torch.cat([prompt[0], torch.tensor([a])])[None]).logits[0, -1], -1)
                               for a in range(16)])
    expected = (p1[:, None] * seconds).sum(0) * rows
    counts = torch.bincount(out[:, 5], minlength=16).float()
    keep = expected > 5
    assert float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()) < 37.7


def test_seeded_sampling_is_deterministic():
    model = hf_specdec.enable(tiny_model())
    ids, mask = left_padded_batch([6, 9, 4], vocab=64)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=0.8, eos_token_id=None,
                  spec_mode="mtp")
    torch.manual_seed(3)
    first = model.generate(ids, **kwargs)
    torch.manual_seed(3)
    assert torch.equal(first, model.generate(ids, **kwargs))


def test_without_mtp_layers_plain_decoding_works_and_mtp_is_refused():
    ref, ours = tiny_model(num_mtp=0), hf_specdec.enable(tiny_model(num_mtp=0))
    ids, mask = left_padded_batch([5, 7], vocab=64)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    with pytest.raises(ValueError, match="no MTP weights"):
        ours.generate(ids, spec_mode="mtp", **kwargs)
    with pytest.raises(ValueError, match="num_speculative_tokens <= 3"):
        hf_specdec.enable(tiny_model()).generate(ids, spec_mode="mtp", num_speculative_tokens=4, **kwargs)
