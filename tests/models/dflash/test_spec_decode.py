"""DFlash speculative decoding end to end through the shared loop (`DFlashDraftRunner`): greedy losslessness
(invariant 1), the drafter's paged context after a partial rejection (invariant 3 for the drafter), the sampled
distribution (invariant 4), seeded determinism (5), and the acceptance sequence of the reference loop.

The drafters are distilled for a second on their target's own greedy outputs (`fit_drafter`), so rounds mix
full, partial and zero acceptance and every test exercises rollback. Prompts and generations pass the
targets' sliding window (8) and the Gemma drafters' own (6).
"""

import functools

import pytest
import torch
from transformers import LogitsProcessorList

import hf_specdec
from hf_specdec.generation.drafter import DraftSelector
from hf_specdec.runtime import ModelRunner
from hf_specdec.generation.sampling import PositionScorer
from hf_specdec.models.dflash import DenseDFlashContext, DFlashDrafter, PagedDFlashContext, DFlashDraftRunner
from tests.distribution import assert_follows, second_token_marginal
from tests.models.dflash.helpers import (
    F,
    S,
    drafter_config_dict,
    fit_drafter,
    gemma4_conditional_generation,
    greedy_continuations,
    random_drafter,
    random_state_dict,
    released_layout,
    write_checkpoint,
)
from tests.models.dflash.reference_loop import reference_dflash_generate
from tests.tiny_models import (gemma4_26b_style, gemma4_31b_style, gemma4_e2b_style, gpt_oss, left_padded_batch, llama,
                               mistral)

GEMMA_DRAFTER = dict(layer_types=[S, F], use_sliding_window=True, sliding_window=6)  # as Gemma 4 DFlash drafters
TARGETS = {
    "gemma4_e2b": (gemma4_e2b_style, GEMMA_DRAFTER),  # drafter reads layer 5: KV-shared, skipped by an int keep
    "gemma4_31b": (gemma4_31b_style, GEMMA_DRAFTER),
    "gemma4_26b": (gemma4_26b_style, GEMMA_DRAFTER),  # an MoE target
    "gemma4_multimodal": (gemma4_conditional_generation, GEMMA_DRAFTER),
    "llama": (llama, {}),
    "mistral": (mistral, {}),  # a sliding window on every layer, without layer_types
    "gpt_oss": (gpt_oss, {}),  # learned softmax sinks, an MoE of transformers' own experts (z-lab's gpt-oss drafters)
}
NEW_TOKENS = 22
REFERENCE_SEEDS = (0, 3)  # single prompts of the reference-loop comparison
_PAIRS: dict = {}


def prompt_batch():
    """Left-padded prompts of 13, 4, 9 and 6 tokens."""
    return left_padded_batch([13, 4, 9, 6], seed=1)


def trained_pair(name: str, block_size: int):
    """(plain target, enabled target, drafter distilled on the target's continuations of the test prompts),
    built once per module run."""
    if (name, block_size) not in _PAIRS:
        make_target, drafter_kwargs = TARGETS[name]
        plain, target = make_target(), make_target()
        drafter = random_drafter(target, block_size=block_size, **drafter_kwargs)
        ids, mask = prompt_batch()
        prompts = [left_padded_batch([12], seed=s)[0] for s in REFERENCE_SEEDS]
        prompts += [row[m.bool()][None] for row, m in zip(ids, mask)]
        continuations = [greedy_continuations(target, [p], 40)[:, -44:] for p in prompts]
        fit_drafter(target, drafter, torch.cat(continuations))
        _PAIRS[name, block_size] = plain, hf_specdec.enable(target), drafter
    return _PAIRS[name, block_size]


class RecordingDrafter(DFlashDraftRunner):
    """Records each round's accepted counts (one list per verify step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.accepted: list[list[int]] = []

    def commit(self, context, captured, num_accepted, kept):
        self.accepted.append(num_accepted.tolist())
        super().commit(context, captured, num_accepted, kept)


@pytest.mark.parametrize("name,block_size,k", [("gemma4_e2b", 8, None), ("gemma4_31b", 4, None), ("llama", 2, None),
                                               ("gemma4_e2b", 5, 2), ("gemma4_multimodal", 4, None),
                                               ("gemma4_26b", 4, None), ("mistral", 4, None), ("gpt_oss", 4, None)])
def test_greedy_dflash_equals_plain_greedy(name, block_size, k):
    plain, target, drafter = trained_pair(name, block_size)
    ids, mask = prompt_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = plain.generate(ids, **kwargs)
    recorder = RecordingDrafter(target, drafter, k)
    assert torch.equal(target.generate(ids, assistant_model=recorder, **kwargs), expected)
    k = k or block_size - 1
    counts = {a for step in recorder.accepted for a in step}
    assert counts & set(range(1, k + 1)) and 0 in counts, counts  # rounds with accepted drafts and with none
    assert torch.equal(target.generate(ids, assistant_model=drafter, num_speculative_tokens=k, **kwargs), expected)
    stats = hf_specdec.last_generation_stats(target)
    assert (stats.spec_mode, stats.num_speculative_tokens) == ("dflash", k)
    assert stats.num_generated_tokens == NEW_TOKENS * 4 and stats.mean_accepted_length > 1.0


@pytest.mark.parametrize("name,block_size,k,seed", [("gemma4_e2b", 5, None, REFERENCE_SEEDS[1]), ("gemma4_31b", 4, 2, REFERENCE_SEEDS[0]),
                                                    ("llama", 5, None, REFERENCE_SEEDS[1])])
def test_acceptance_sequence_equals_the_reference_loop(name, block_size, k, seed):
    """Batch 1: our paged loop accepts exactly what the independent dense re-implementation of z-lab's loop
    accepts, round by round, and emits the same tokens."""
    _, target, drafter = trained_pair(name, block_size)
    ids = left_padded_batch([12], seed=seed)[0]
    hf_specdec.disable(target)
    try:
        reference = reference_dflash_generate(target, drafter, ids, 40, num_speculative_tokens=k)
    finally:
        hf_specdec.enable(target)
    recorder = RecordingDrafter(target, drafter, k)
    out = target.generate(ids, assistant_model=recorder, max_new_tokens=40, do_sample=False, eos_token_id=None)
    assert out[0].tolist() == reference.tokens
    assert [a for (a,) in recorder.accepted] == reference.acceptance
    assert len(set(reference.acceptance)) > 1


@pytest.mark.parametrize("name,block_size", [("gemma4_e2b", 5), ("gemma4_31b", 4), ("llama", 5)])
def test_drafter_context_after_a_partial_rejection_equals_a_fresh_run(name, block_size):
    """Verify 5 tokens per row and keep 3 of one row, 1 of another: the drafter's context pages and its next
    block's drafts must equal those of a drafter that only ever saw the kept tokens (no K/V of rejected or
    block tokens), for sliding (released pages) and full draft layers."""
    _, target, drafter = trained_pair(name, block_size)
    lens, verify = [21, 7], torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    ids, _ = left_padded_batch(lens, seed=2)
    config = hf_specdec.CacheConfig(block_size=1)  # one-token pages: sliding layers release exactly
    with_rejection = run_drafter(target, drafter, ids, lens, config, verify=verify, kept=[3, 1])
    rows = [torch.cat([ids[b, ids.shape[1] - n:], verify[b, :k]]) for b, (n, k) in enumerate(zip(lens, [3, 1]))]
    kept_ids = torch.zeros(2, len(rows[0]), dtype=torch.long)
    for b, row in enumerate(rows):
        kept_ids[b, kept_ids.shape[1] - len(row):] = row
    fresh = run_drafter(target, drafter, kept_ids, [len(r) for r in rows], config)
    assert with_rejection["lens"] == fresh["lens"] == [24, 8]
    sliding = [i for i, t in enumerate(drafter.config.layer_types) if t == S]
    assert all(with_rejection["starts"][i][0] > 0 for i in sliding)  # old context pages were released
    assert with_rejection["starts"] == fresh["starts"]
    for (k1, v1), (k2, v2) in zip(with_rejection["kv"], fresh["kv"]):
        torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)
    assert torch.equal(with_rejection["drafts"], fresh["drafts"])


@pytest.mark.parametrize("name,block_size,groups", [("llama", 5, 1), ("mistral", 4, 1), ("gemma4_31b", 4, 2)])
def test_cpu_context_append_takes_the_kept_tokens(name, block_size, groups, monkeypatch):
    """On the CPU the drafter's context append computes the features and K/V of the kept tokens only (a verify's
    rejected drafts have no slot) and writes draft layers of one KV group with one write per storage: after a prefill
    and a verify that rejects drafts, the context pages, their starts and the next drafts are those of the append
    over every token of the forward, layer by layer (sliding and full draft layers: two groups)."""
    from hf_specdec.kernels import store_kv

    _, target, drafter = trained_pair(name, block_size)
    assert len(DFlashDraftRunner(target, drafter).layout.groups) == groups
    lens, verify = [21, 7], torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    ids, _ = left_padded_batch(lens, seed=3)
    config = hf_specdec.CacheConfig(block_size=2)
    tokens = []
    features = DFlashDrafter.context_features
    monkeypatch.setattr(DFlashDrafter, "context_features",
                        lambda self, hidden: tokens.append(hidden[0].shape[:2]) or features(self, hidden))
    ours = run_drafter(target, drafter, ids, lens, config, verify=verify, kept=[4, 2])
    assert tokens == [(1, 21 + 7), (1, 4 + 2)]  # the prompts' tokens, then the verify's kept ones

    def every_token(self, *hidden_and_meta):
        *hidden, meta = hidden_and_meta
        context = features(self.drafter, hidden)
        for layer, (keys, values) in enumerate(self.drafter.context_kv_all_layers(context, meta.position_ids)):
            store_kv(keys.flatten(0, 1), values.flatten(0, 1), *self.cache.layer_storage(layer),
                     meta.slot_mapping[self.layout.layer_slot[layer][0]])

    monkeypatch.setattr(DFlashDraftRunner, "_store_context", every_token)
    reference = run_drafter(target, drafter, ids, lens, config, verify=verify, kept=[4, 2])
    assert ours["lens"] == reference["lens"] and ours["starts"] == reference["starts"]
    for (k1, v1), (k2, v2) in zip(ours["kv"], reference["kv"]):
        torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours["drafts"], reference["drafts"])


def run_drafter(target, drafter, ids, lens, cache_config, verify=None, kept=None) -> dict:
    """Prefill `ids` through the paged runner with the drafter capturing; optionally one verify forward of
    `verify` [batch, q] keeping `kept[b]` tokens per row; then the drafter's context and its next drafts."""
    paged = DFlashDraftRunner(target, drafter)
    runner = ModelRunner(target, target._hf_specdec.layout, cache_config)
    runner.start(lens, 10, lookahead=5)
    try:
        with torch.no_grad(), paged.capture(target) as captured:
            runner.forward(ids, lens, keep_logits=1)
            runner.commit(lens)
            paged.begin(runner.context, captured)
            if verify is not None:
                runner.forward(verify, [verify.shape[1]] * len(lens))
                runner.commit([n + k for n, k in zip(lens, kept)])
                paged.commit(runner.context, captured, torch.tensor(kept) - 1, kept)
            rows = range(len(lens))
            layers = range(len(drafter.layers))
            kv = [paged.cache.gather(b, layer)[:2] for layer in layers for b in rows]
            starts = [[paged.cache.gather(b, layer)[2] for b in rows] for layer in layers]
            selector = DraftSelector(False, PositionScorer(LogitsProcessorList()), 97, [])
            last = torch.tensor([5, 9])
            drafts = paged.propose(last, runner.context, selector).tokens
            assert paged.cache.seq_lens == runner.cache.seq_lens  # the block was dropped again
            return {"lens": paged.cache.seq_lens, "kv": kv, "starts": starts, "drafts": drafts}
    finally:
        runner.finish()


@pytest.mark.parametrize("make_target", [functools.partial(gemma4_e2b_style, vocab_size_per_layer_input=16),
                                         gemma4_26b_style, gpt_oss], ids=["e2b", "moe_26b", "gpt_oss"])
def test_sampled_dflash_tokens_follow_the_target_distribution(make_target):
    """Invariant 4 in DFlash mode: the 2nd generated token (decided by rejection sampling against a random
    drafter's block) has the target's exact marginal, over a dense and two MoE targets (one with softmax sinks)."""
    target = hf_specdec.enable(make_target(vocab_size=16))
    drafter = random_drafter(target, block_size=3, mask_token_id=15, **GEMMA_DRAFTER)
    rows, prompt = 3000, torch.tensor([[3, 5, 9, 7]])
    torch.manual_seed(0)
    out = target.generate(prompt.expand(rows, 4), attention_mask=torch.ones(rows, 4, dtype=torch.long),
                          assistant_model=drafter, max_new_tokens=2, do_sample=True, eos_token_id=None, pad_token_id=0)
    stats = hf_specdec.last_generation_stats(target)
    assert stats.spec_mode == "dflash" and 0 < stats.num_accepted_tokens < rows * 2
    hf_specdec.disable(target)
    assert_follows(out[:, 5], second_token_marginal(target, prompt, 16))


def test_seeded_dflash_sampling_is_deterministic():
    _, target, drafter = trained_pair("gemma4_31b", 4)
    ids, mask = left_padded_batch([6, 9, 4, 7])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.7, eos_token_id=None,
                  assistant_model=drafter)
    torch.manual_seed(5)
    first = target.generate(ids, **kwargs)
    torch.manual_seed(5)
    assert torch.equal(first, target.generate(ids, **kwargs))
    torch.manual_seed(6)
    assert not torch.equal(first, target.generate(ids, **kwargs))


def test_spec_mode_is_inferred_and_checked(tmp_path):
    _, target, drafter = trained_pair("llama", 5)
    ids, mask = left_padded_batch([5, 3])
    target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=3)
    assert hf_specdec.last_generation_stats(target).spec_mode == "dflash"
    target.generate(ids, attention_mask=mask, assistant_model=drafter, spec_mode="dflash", max_new_tokens=3)
    with pytest.raises(ValueError, match="'dflash' drafter"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, spec_mode="mtp", max_new_tokens=3)
    with pytest.raises(ValueError, match="block_size=5: pass num_speculative_tokens <= 4"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, num_speculative_tokens=5, max_new_tokens=3)
    wider = hf_specdec.enable(llama(hidden_size=48))
    with pytest.raises(ValueError, match="hidden_size 32 but the target has 48"):
        wider.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=3)


def test_capture_key_names_the_hooked_target_layers():
    """Target forwards replayed from CUDA graphs restore what the hooks recorded at capture: the key keeps a
    drafter reading other layers from reusing them."""
    target = llama(num_hidden_layers=4)
    first = DFlashDraftRunner(target, random_drafter(target, target_layer_ids=[0, 2]))
    same = DFlashDraftRunner(target, random_drafter(target, seed=1, target_layer_ids=[0, 2]))
    other = DFlashDraftRunner(target, random_drafter(target, target_layer_ids=[1, 3]))
    assert first.capture_key == same.capture_key != other.capture_key


def test_bidirectional_sliding_layers_need_blocks_within_their_window():
    target = gemma4_31b_style()
    drafter = random_drafter(target, block_size=8, layer_types=[S, S], use_sliding_window=True, sliding_window=4,
                             is_causal=False)
    assert DFlashDraftRunner(target, drafter, 3).num_speculative_tokens == 3
    with pytest.raises(ValueError, match="pass num_speculative_tokens <= 3"):
        DFlashDraftRunner(target, drafter)


def test_auto_model_loads_a_dflash_checkpoint(tmp_path):
    """`hf_specdec.AutoModelForCausalLM` returns the drafter for a z-lab checkpoint (model_type qwen3), which
    transformers alone would load as a Qwen3 model."""
    target = llama()
    config = drafter_config_dict(target)
    path = write_checkpoint(tmp_path / "drafter", config, random_state_dict(released_layout(config)))
    drafter = hf_specdec.AutoModelForCausalLM.from_pretrained(path)
    assert type(drafter) is DFlashDrafter and drafter.block_size == 4
    ours = hf_specdec.enable(llama())
    ids, mask = left_padded_batch([7, 5])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(ours.generate(ids, assistant_model=drafter, **kwargs), target.generate(ids, **kwargs))


@pytest.mark.parametrize("variant", [dict(), dict(layer_types=[S, F], use_sliding_window=True, sliding_window=6),
                                     dict(is_causal=True),
                                     dict(layer_types=[S, S], use_sliding_window=True, sliding_window=6, is_causal=False)])
def test_paged_block_forward_equals_the_dense_context(variant):
    """One block forward over the paged context of a left-padded batch equals the dense reference context,
    for bidirectional, causal and sliding draft layers (rows longer and shorter than the window)."""
    target = hf_specdec.enable(gemma4_31b_style())
    drafter = random_drafter(target, block_size=6, **variant)
    lens = [13, 4, 9]
    ids, mask = left_padded_batch(lens, seed=4)
    paged = DFlashDraftRunner(target, drafter)
    runner = ModelRunner(target, target._hf_specdec.layout, hf_specdec.CacheConfig(block_size=2))
    runner.start(lens, 4, lookahead=6)
    try:
        with torch.no_grad(), paged.capture(target) as captured:
            runner.forward(ids, lens, keep_logits=1)
            runner.commit(lens)
            paged.begin(runner.context, captured)
            features = drafter.context_features(list(captured))
            embeds = drafter.embed_block(target, drafter.block_input_ids(torch.tensor([5, 7, 11])))
            meta = paged.cache.begin_forward([6] * 3, 6)
            got = drafter.draft_block(embeds, meta.position_ids, PagedDFlashContext(paged.cache, meta))
            dense = DenseDFlashContext.from_features(drafter, features, mask.bool())
            expected = drafter.draft_block(embeds, torch.tensor(lens)[:, None] + torch.arange(6), dense)
    finally:
        runner.finish()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant, groups", [
    (dict(), [(0, 1)]),
    (dict(layer_types=[S, F], use_sliding_window=True, sliding_window=6), [(0,), (1,)]),
    (dict(layer_types=[S, F, S], use_sliding_window=True, sliding_window=6), [(0, 2), (1,)]),
])
def test_draft_layers_alike_share_one_kv_group(variant, groups):
    """Draft layers of one (kv heads, head_dim, window) share a KV group (one block table a row, one plan a forward);
    each still owns its pages."""
    target = gemma4_31b_style()
    layers = len(variant.get("layer_types", [F, F]))
    drafter = random_drafter(target, block_size=4, num_hidden_layers=layers, **variant)
    layout = DFlashDraftRunner(target, drafter).layout
    assert [g.layers for g in layout.groups] == groups
    assert layout.producer == {i: i for i in range(layers)}
    assert len(set(layout.layer_slot.values())) == layers


def test_the_target_gets_an_integer_logits_to_keep_with_kv_shared_layers_captured():
    """The drafter reads a KV-shared layer of an E2B-style target, which the text model would compute only at the
    kept position for an integer ``logits_to_keep``; the index tensor that keeps every position goes to the text
    model only. Given to the causal LM it would reach its LM head on the device accelerate moved the arguments to,
    which under a two-GPU map need not be the final norm's (the error a two-GPU run hit)."""
    _, target, drafter = trained_pair("gemma4_e2b", 8)
    seen, forward = [], target.forward

    @functools.wraps(forward)  # its signature: the cache goes by the name the forward takes
    def recording_forward(*args, **kwargs):  # what the forward gets after every pre-hook ran
        seen.append(type(kwargs.get("logits_to_keep")))
        return forward(*args, **kwargs)

    target.forward = recording_forward
    try:
        ids, mask = prompt_batch()
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4, do_sample=False)
    finally:
        del target.forward
    assert seen and all(t is int for t in seen)
