"""What the drafter borrows from the target: hooked hidden states, block embeddings, the soft-capped head."""

import pytest
import torch
import torch.nn as nn
from transformers import DynamicCache

from hf_specdec.compat import cache_argument
from hf_specdec.models.dflash import (
    capture_hidden_states,
    check_compatible,
    target_block_embeddings,
    target_head_logits,
    target_layer_hidden_modules,
)
from tests.models.dflash.helpers import drafter_config, gemma4_conditional_generation
from tests.tiny_models import gemma4_31b_style, gemma4_e2b_style, left_padded_batch, llama, qwen3


TARGETS = {
    "gemma4_e2b": gemma4_e2b_style,
    "gemma4_31b": gemma4_31b_style,
    "gemma4_multimodal": gemma4_conditional_generation,
    "llama": llama,
    "qwen3": qwen3,
}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request):
    return TARGETS[request.param]()


def test_hooks_reproduce_output_hidden_states(target):
    """Module outputs equal `output_hidden_states[i + 1]` for every layer (the last one after the final norm),
    in a prefill and in a multi-token step over a cache, as the verify forward will be."""
    num_layers = target.config.get_text_config().num_hidden_layers
    layer_ids = list(range(num_layers))
    ids, mask = left_padded_batch([11, 7])
    cache = DynamicCache()  # config-less: every layer keeps all K/V, so crop works on 5.17 too
    with torch.no_grad(), capture_hidden_states(target, layer_ids) as captured:
        expected = target(ids, attention_mask=mask, **{cache_argument(target): cache},
                          output_hidden_states=True).hidden_states
        assert all(torch.equal(got, expected[i + 1]) for i, got in zip(layer_ids, captured))
        step = torch.tensor([[5, 6, 7], [8, 9, 10]])
        mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        target(step, attention_mask=mask, **{cache_argument(target): cache})  # no output_hidden_states: hooks alone
        hooked = list(captured)
    cache.crop(-3)
    with torch.no_grad():
        expected = target(step, attention_mask=mask, **{cache_argument(target): cache},
                          output_hidden_states=True).hidden_states
    for i, got in zip(layer_ids, hooked):
        assert got.shape == (2, 3, target.config.get_text_config().hidden_size)
        torch.testing.assert_close(got, expected[i + 1], rtol=0, atol=1e-6)


def test_kv_shared_layers_are_captured_whole_with_an_index_logits_to_keep():
    """Gemma 4 E2B skips unkept positions in its KV-shared layers (4, 5) for an int `logits_to_keep` (5.2x);
    an index tensor keeps one logit row and every captured position."""
    target = gemma4_e2b_style()
    ids, _ = left_padded_batch([10])
    with torch.no_grad(), capture_hidden_states(target, [1, 4, 5]) as captured:
        logits = target(ids, logits_to_keep=torch.tensor([9])).logits
        assert logits.shape[1] == 1 and [h.shape[1] for h in captured] == [10, 10, 10]


def test_capture_removes_its_hooks(target):
    modules = target_layer_hidden_modules(target, [0, 1])
    before = [len(m._forward_hooks) for m in modules]
    with capture_hidden_states(target, [0, 1]):
        assert [len(m._forward_hooks) for m in modules] == [n + 1 for n in before]
    assert [len(m._forward_hooks) for m in modules] == before
    with pytest.raises(ValueError, match="out of range"):
        target_layer_hidden_modules(target, [99])


def test_head_logits_are_the_targets_logits(target):
    ids, mask = left_padded_batch([9, 4])
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
        torch.testing.assert_close(target_head_logits(target, out.hidden_states[-1]), out.logits)


def test_block_embeddings_are_the_targets_input_embeddings(target):
    ids = torch.tensor([[3, 96, 96]])
    embed = target.get_input_embeddings()
    assert torch.equal(target_block_embeddings(target, ids), embed(ids))  # Gemma 4: x sqrt(hidden) included
    torch.testing.assert_close(target_block_embeddings(target, ids, scale=2.0), 2.0 * embed.weight[ids])


def test_embedding_norms_are_skipped():
    """An input embedding with an `embed_norm` (MuseGlimmer-style) gives its raw rows, as transformers' DFlash does."""

    class NormedEmbedding(nn.Embedding):
        def __init__(self):
            super().__init__(10, 4)
            self.embed_norm = nn.LayerNorm(4)

        def forward(self, ids):
            return self.embed_norm(super().forward(ids))

    target = llama(vocab_size=10)
    target.set_input_embeddings(NormedEmbedding())
    ids = torch.tensor([[1, 2]])
    assert torch.equal(target_block_embeddings(target, ids), target.get_input_embeddings().weight[ids])


@pytest.mark.parametrize(
    "target_kwargs, match",
    [(dict(hidden_size=48), "hidden_size"), (dict(num_hidden_layers=4), "num_target_layers"),
     (dict(vocab_size=90), "mask_token_id")],
)
def test_incompatible_targets_raise(target_kwargs, match):
    config = drafter_config(llama())
    check_compatible(config, llama())
    with pytest.raises(ValueError, match=match):
        check_compatible(config, llama(**target_kwargs))
