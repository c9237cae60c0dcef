"""Gemma 4 MTP speculative decoding end to end: losslessness (invariant 1), the drafter's context after a
partial rejection (invariant 3 for the drafter), the sampled distribution (invariant 4), determinism (5)."""

import pytest
import torch

import hf_specdec
from hf_specdec.compat import cache_argument
from hf_specdec.runtime import ModelRunner
from hf_specdec.models.gemma4 import DenseTargetKVSource, Gemma4MTPAssistant, Gemma4MTPDraftRunner, PagedTargetKVSource
from tests.distribution import assert_follows, second_token_marginal, second_tokens_of_sampled_mtp
from tests.models.gemma4.helpers import assistant_config_dict, random_state_dict, released_layout, write_checkpoint
from tests.tiny_models import gemma4_26b_style, gemma4_31b_style, gemma4_e2b_style, left_padded_batch

TARGETS = {"e2b": gemma4_e2b_style, "31b": gemma4_31b_style, "26b": gemma4_26b_style}  # 26b: an MoE target
VOCAB = 96  # divisible by the centroid count


def _assistant(tmp_path, target, ordered, seed=0):
    config = assistant_config_dict(target.config, ordered)
    path = write_checkpoint(tmp_path / f"assistant-{ordered}-{seed}", config,
                            random_state_dict(released_layout(config), seed))
    return hf_specdec.AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("style,ordered,k", [("e2b", True, 3), ("31b", False, 8), ("31b", True, 1),
                                              ("e2b", False, 4), ("26b", False, 3)])
def test_greedy_mtp_equals_plain_greedy(tmp_path, style, ordered, k):
    ref = TARGETS[style](vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB)
    target = hf_specdec.enable(TARGETS[style](vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB))
    assistant = _assistant(tmp_path, target, ordered)
    assert isinstance(assistant, Gemma4MTPAssistant)
    ids, mask = left_padded_batch([13, 4, 9, 6], vocab=VOCAB)  # prompt + output past the window (8)
    kwargs = dict(attention_mask=mask, max_new_tokens=22, do_sample=False, eos_token_id=None)
    expected = ref.generate(ids, **kwargs)
    got = target.generate(ids, assistant_model=assistant, num_speculative_tokens=k, **kwargs)
    assert torch.equal(got, expected)
    stats = hf_specdec.last_generation_stats(target)
    assert stats.spec_mode == "mtp" and stats.num_speculative_tokens == k
    assert stats.num_generated_tokens == 22 * 4


def test_spec_mode_is_inferred_and_checked(tmp_path):
    target = hf_specdec.enable(gemma4_e2b_style(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB))
    assistant = _assistant(tmp_path, target, True)
    ids, mask = left_padded_batch([5, 3], vocab=VOCAB)
    target.generate(ids, attention_mask=mask, assistant_model=assistant, spec_mode="mtp", max_new_tokens=3)
    assert hf_specdec.last_generation_stats(target).spec_mode == "mtp"
    with pytest.raises(ValueError, match="'mtp' drafter"):
        target.generate(ids, attention_mask=mask, assistant_model=assistant, spec_mode="dflash", max_new_tokens=3)
    wider = hf_specdec.enable(gemma4_e2b_style(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=48))
    with pytest.raises(ValueError, match="built for a target with hidden_size 32"):
        wider.generate(ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=3)


@pytest.mark.parametrize("style", ["e2b", "31b"])
def test_drafter_context_after_a_partial_rejection_equals_a_fresh_run(tmp_path, style):
    """Verify 4 tokens of which the first 2 are kept: the drafter must read exactly the K/V of a fresh
    target run over the kept tokens (no stale K/V of the rejected ones), for sliding and full layers."""
    target = hf_specdec.enable(TARGETS[style](vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB),
                               hf_specdec.CacheConfig(block_size=1))  # one-token blocks: exact releases
    assistant = _assistant(tmp_path, target, True)
    drafter = Gemma4MTPDraftRunner(target, assistant, 3)
    ids, mask = left_padded_batch([21, 7], vocab=VOCAB)
    runner = ModelRunner(target, target._hf_specdec.layout, target._hf_specdec.cache_config)
    runner.start([21, 7], 10, lookahead=4)
    runner.forward(ids, [21, 7], keep_logits=1)
    runner.commit([21, 7])
    verify = torch.randint(3, VOCAB, (2, 4))
    runner.forward(verify, [4, 4])
    runner.commit([21 + 2, 7 + 2])  # keep the first 2 verified tokens of each row
    sliding_group = target._hf_specdec.layout.layer_slot[drafter.producers["sliding_attention"]][0]
    assert runner.cache.block_table_tensor(sliding_group)[0, 0] == -1  # old pages were released
    positions = torch.tensor(runner.cache.seq_lens)
    paged = PagedTargetKVSource(runner.cache, drafter.producers, positions)
    for row, (n, width) in enumerate(((21, 21), (7, 21))):
        kept = torch.cat([ids[row, width - n:], verify[row, :2]])[None]
        fresh = gemma4_target_cache(target, kept)
        dense = DenseTargetKVSource.from_cache(fresh, target.config)
        for layer_type, window in (("sliding_attention", 9), ("full_attention", None)):
            head_dim = target._hf_specdec.layout.group_of(drafter.producers[layer_type]).head_dim
            query = torch.randn(1, 1, 4, head_dim)
            mine = paged.attend(layer_type, torch.cat([query, query]), scaling=1.0, sliding_window=window)[row]
            theirs = dense.attend(layer_type, query, scaling=1.0, sliding_window=window)[0]
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    runner.finish()


def gemma4_target_cache(target, ids):
    from transformers import DynamicCache

    hf_specdec.disable(target)
    try:
        cache = DynamicCache()  # no config: every layer keeps its full length (no sliding cropping)
        target(ids, **{cache_argument(target): cache}, use_cache=True)
    finally:
        hf_specdec.enable(target)
    return cache


def test_sampled_mtp_tokens_follow_the_target_distribution(tmp_path):
    """Invariant 4 in MTP mode: the 2nd generated token (decided by rejection sampling against a random
    assistant with a centroid head) has the target's exact marginal."""
    target = hf_specdec.enable(gemma4_e2b_style(vocab_size=16, vocab_size_per_layer_input=16))
    config = assistant_config_dict(target.config, True, num_centroids=4, top_k=2)
    assistant = Gemma4MTPAssistant.from_pretrained(write_checkpoint(
        tmp_path / "a", config, random_state_dict(released_layout(config), 3)))
    rows, prompt = 3000, torch.tensor([[3, 5, 9, 7]])
    torch.manual_seed(0)
    out = target.generate(prompt.expand(rows, 4), attention_mask=torch.ones(rows, 4, dtype=torch.long),
                          assistant_model=assistant, num_speculative_tokens=2, max_new_tokens=2, do_sample=True,
                          eos_token_id=None, pad_token_id=0)
    hf_specdec.disable(target)
    assert_follows(out[:, 5], second_token_marginal(target, prompt, 16))


def test_sampled_mtp_tokens_over_an_moe_target_follow_its_distribution(tmp_path):
    """Invariant 4 with a mixture-of-experts target (26B-A4B style) and a centroid-free assistant (tied dense
    head, as the 26B-A4B's): the verify forwards route k+1 tokens per row through the experts."""
    target = hf_specdec.enable(gemma4_26b_style(vocab_size=16))
    config = assistant_config_dict(target.config, False)
    assistant = Gemma4MTPAssistant.from_pretrained(write_checkpoint(
        tmp_path / "a", config, random_state_dict(released_layout(config), 4)))
    assert assistant.masked_embedding is None
    prompt = torch.tensor([[3, 5, 9, 7]])
    samples = second_tokens_of_sampled_mtp(target, assistant, prompt)
    hf_specdec.disable(target)
    assert_follows(samples, second_token_marginal(target, prompt, 16))


def test_seeded_mtp_sampling_is_deterministic(tmp_path):
    target = hf_specdec.enable(gemma4_31b_style(vocab_size=VOCAB))
    assistant = _assistant(tmp_path, target, True)
    ids, mask = left_padded_batch([6, 9, 4, 7], vocab=VOCAB)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.7, eos_token_id=None,
                  assistant_model=assistant, num_speculative_tokens=3)
    torch.manual_seed(5)
    first = target.generate(ids, **kwargs)
    torch.manual_seed(5)
    assert torch.equal(first, target.generate(ids, **kwargs))


def test_conditional_generation_targets_work_plain_and_with_mtp(tmp_path):
    """Gemma4ForConditionalGeneration (text prompts): same tokens as transformers, plain and MTP."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = gemma4_e2b_style(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB).config
    config = Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).eval()
    ids, mask = left_padded_batch([9, 5, 12], vocab=VOCAB)
    kwargs = dict(attention_mask=mask, max_new_tokens=14, do_sample=False)
    expected = model.generate(ids, **kwargs)
    hf_specdec.enable(model)
    assert torch.equal(model.generate(ids, **kwargs), expected)
    assistant = _assistant(tmp_path, model, True)
    assert torch.equal(model.generate(ids, assistant_model=assistant, num_speculative_tokens=3, **kwargs), expected)


@pytest.mark.usefixtures("cpu_drafts_ahead")  # rounds of k draft steps, drafted before the read-back
def test_hooks_on_assistant_layers_see_every_draft_step():
    """Drafting folds each assistant block's input norm into the previous block's last seam, which calls the
    blocks' fused forward directly; a block with a hook (e.g. accelerate's offloading) is called as a module
    instead: the hook sees every draft step, and the drafts are the same (same target forwards)."""
    import transformers

    from hf_specdec.assets import asset_path, held_out_snippets

    target = transformers.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"), dtype=torch.float32)
    assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-assistant"),
                                                                dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))
    hf_specdec.enable(target)
    ids = tokenizer(held_out_snippets()[0]["text"][:160], return_tensors="pt").input_ids
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, assistant_model=assistant,
                  num_speculative_tokens=3)
    runs, calls = [], []
    for hooked in (False, True):
        if hooked:
            assistant.model.layers[1].register_forward_hook(lambda module, args, out: calls.append(out.shape))
        out = target.generate(ids, **kwargs)
        runs.append((out, hf_specdec.last_generation_stats(target).num_target_forwards))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1] < 20
    # every draft step of every round: one round per verify (and maybe one queued ahead after the last)
    assert len(calls) % 3 == 0 and 3 * (runs[1][1] - 1) <= len(calls) <= 3 * runs[1][1]


def test_the_assistant_is_stacked_once_until_its_weights_change(tmp_path, monkeypatch):
    """Every generate call builds a draft runner; the assistant's projections are stacked by the first only,
    and again after its weights were replaced (a cast gives new tensors)."""
    from hf_specdec.models.gemma4 import mtp_drafter

    target = hf_specdec.enable(TARGETS["31b"](vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB))
    assistant = _assistant(tmp_path, target, True)
    calls = []
    monkeypatch.setattr(mtp_drafter, "stack_projections", lambda module: calls.append(module))
    Gemma4MTPDraftRunner(target, assistant, 2)
    first = len(calls)
    assert first == len(list(assistant.modules()))
    Gemma4MTPDraftRunner(target, assistant, 3)
    assert len(calls) == first
    assistant.to(torch.float64).to(torch.float32)
    Gemma4MTPDraftRunner(target, assistant, 2)
    assert len(calls) == 2 * first
