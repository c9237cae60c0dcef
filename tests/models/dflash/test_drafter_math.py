"""The drafter's math against the independent reference forward (`reference_loop.ReferenceDrafter`)."""

import copy

import pytest
import torch

from hf_specdec.kernels.stacked_linear import stacked_weight
from hf_specdec.models.dflash import DenseDFlashContext, block_attention_mask
from tests.models.dflash.helpers import F, S, random_drafter
from tests.models.dflash.reference_loop import ReferenceDrafter, draft_logits, embed
from tests.tiny_models import gemma4_31b_style

VARIANTS = {
    "bidirectional": dict(),
    "sliding_causal": dict(layer_types=[S, F], use_sliding_window=True, sliding_window=6),
    "sliding_bidirectional": dict(layer_types=[S, S], use_sliding_window=True, sliding_window=3, is_causal=False),
    "all_causal": dict(is_causal=True),
}


@pytest.fixture(scope="module")
def target():
    return gemma4_31b_style()


@pytest.fixture(scope="module", params=list(VARIANTS))
def drafter(request, target):
    return random_drafter(target, block_size=5, **VARIANTS[request.param])


def target_features(target, drafter, ids):
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1] for i in drafter.target_layer_ids], dim=-1)


def reference_block(target, drafter, features, block_ids, start):
    """The reference forward over `features` of positions 0..start-1 and the block at start.."""
    ref = ReferenceDrafter(drafter)
    positions = torch.arange(0, start + block_ids.shape[1])
    return ref.forward(features[:, :start], embed(target, drafter.config, block_ids), positions), ref


def ours_block(target, drafter, context, block_ids, starts):
    positions = starts[:, None] + torch.arange(block_ids.shape[1])
    return drafter.draft_block(drafter.embed_block(target, block_ids), positions, context)


@torch.no_grad()
@pytest.mark.parametrize("start", [3, 10])
def test_draft_block_matches_the_reference_forward(target, drafter, start):
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(start))
    features = target_features(target, drafter, ids)
    block_ids = drafter.block_input_ids(ids[:, start])
    expected, ref = reference_block(target, drafter, features, block_ids, start)
    fused = drafter.context_features(torch.split(features[:, :start], drafter.config.hidden_size, dim=-1))
    context = DenseDFlashContext.from_features(drafter, fused)
    got = ours_block(target, drafter, context, block_ids, torch.tensor([start]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(drafter.draft_logits(target, got), draft_logits(target, drafter.config, expected[:, 1:]),
                               rtol=1e-5, atol=1e-4)
    ref.crop(start)  # what the reference cache keeps: context K/V at positions 0..start-1
    for layer_idx, (keys, values) in enumerate(ref.cache):
        ours_k, ours_v = drafter.context_kv(layer_idx, fused, torch.arange(start)[None])
        torch.testing.assert_close(ours_k, keys.transpose(1, 2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_v, values.transpose(1, 2), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_stacked_projections_keep_the_block_and_the_context(target, drafter):
    """Each layer's q/k/v and gate/up stacked in one storage (what the draft runner does) draft the same block and
    context K/V as separate weights: the same parameters, one GEMM per group."""
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    features = drafter.context_features(torch.split(target_features(target, drafter, ids), 32, dim=-1))
    block_ids = drafter.block_input_ids(ids[:, -1])
    stacked = copy.deepcopy(drafter)
    stacked.stack_projections()
    attention = stacked.layers[0].self_attn
    assert stacked_weight(attention.q_proj, attention.k_proj, attention.v_proj) is not None
    assert stacked_weight(stacked.layers[0].mlp.gate_proj, stacked.layers[0].mlp.up_proj) is not None
    for model in (drafter, stacked):
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in drafter.named_parameters()]
    got = ours_block(target, stacked, DenseDFlashContext.from_features(stacked, features), block_ids,
                     torch.tensor([9, 9]))
    expected = ours_block(target, drafter, DenseDFlashContext.from_features(drafter, features), block_ids,
                          torch.tensor([9, 9]))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for layer_idx in range(len(drafter.layers)):
        for a, b in zip(stacked.context_kv(layer_idx, features, torch.arange(9)[None]),
                        drafter.context_kv(layer_idx, features, torch.arange(9)[None])):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_rows_of_a_padded_batch_match_single_rows(target, drafter):
    """Rows with different context lengths (left padding, and right padding for stale entries) in one
    dense context draft as they do alone."""
    lengths, width = [9, 4, 6], 11
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (3, width), generator=gen)
    features = drafter.context_features(torch.split(target_features(target, drafter, ids), 32, dim=-1))
    valid = torch.zeros(3, width, dtype=torch.bool)
    valid[0, 2:] = True  # left padding
    valid[1, :4] = True  # stale entries after the accepted ones
    valid[2, 3:9] = True
    rows = [features[b, valid[b]][None] for b in range(3)]
    last = ids[torch.arange(3), torch.tensor([10, 3, 8])]
    block_ids = drafter.block_input_ids(last)
    batched = ours_block(target, drafter, DenseDFlashContext.from_features(drafter, features, valid), block_ids,
                         torch.tensor(lengths))
    for b in range(3):
        alone = ours_block(target, drafter, DenseDFlashContext.from_features(drafter, rows[b]), block_ids[b:b + 1],
                           torch.tensor([lengths[b]]))
        torch.testing.assert_close(batched[b:b + 1], alone, rtol=1e-5, atol=1e-5)


def test_block_attention_mask_in_positions():
    positions, valid = torch.tensor([[0, 1, 2, 3, 0]]), torch.tensor([[True, True, True, True, False]])
    start = torch.tensor([4])
    mask = block_attention_mask(positions, valid, start, 3, causal_block=True, sliding_window=3)
    # queries at positions 4, 5, 6 over keys [ctx 0, 1, 2, 3, pad, block 4, 5, 6]
    assert mask[0].int().tolist() == [[0, 0, 1, 1, 0, 1, 0, 0], [0, 0, 0, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1, 1]]
    mask = block_attention_mask(positions, valid, start, 3, causal_block=False, sliding_window=2)
    assert mask[0].int().tolist() == [[0, 0, 0, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]]
    mask = block_attention_mask(positions, valid, start, 2, causal_block=False, sliding_window=None)
    assert mask[0].int().tolist() == [[1, 1, 1, 1, 0, 1, 1]] * 2


def test_fewer_drafts_shorten_the_block(target):
    drafter = random_drafter(target, block_size=5)
    assert drafter.block_input_ids(torch.tensor([7, 8]), 2).tolist() == [[7, 96, 96], [8, 96, 96]]
    assert drafter.block_input_ids(torch.tensor([7])).tolist() == [[7, 96, 96, 96, 96]]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        drafter.block_input_ids(torch.tensor([7]), 5)


@torch.no_grad()
def test_draft_logits_use_the_drafter_head_settings_else_the_targets_softcap(target):
    hidden = torch.randn(1, 3, 32) * 50
    lm = target.get_output_embeddings()(hidden[:, 1:])
    plain = random_drafter(target)
    torch.testing.assert_close(plain.draft_logits(target, hidden), 30 * torch.tanh(lm / 30))  # Gemma 4's cap
    tuned = random_drafter(target, output_multiplier=0.5, final_logit_softcapping=20.0)
    torch.testing.assert_close(tuned.draft_logits(target, hidden), 20 * torch.tanh(0.5 * lm / 20))


@torch.no_grad()
def test_greedy_drafts_take_the_raw_head_whose_argmax_is_the_capped_logits(target):
    """Greedy drafts skip the multiplier and the soft-cap where they keep the order (a positive multiplier): the
    argmax of the raw head is the capped logits'; a negative multiplier reverses the order and keeps them."""
    hidden = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    lm = target.get_output_embeddings()(hidden[:, 1:])
    tuned = random_drafter(target, output_multiplier=0.5, final_logit_softcapping=20.0)
    for drafter in (random_drafter(target), tuned):
        greedy = drafter.greedy_logits(target, hidden)
        assert torch.equal(greedy, lm)
        assert torch.equal(greedy.argmax(-1), drafter.draft_logits(target, hidden).argmax(-1))
    flipped = random_drafter(target, output_multiplier=-1.0)
    assert torch.equal(flipped.greedy_logits(target, hidden), flipped.draft_logits(target, hidden))
