"""One draft step of ours == transformers' Gemma4AssistantForCausalLM on the same weights and target K/V."""

import pytest
import torch
from transformers import DynamicCache

from hf_specdec.compat import cache_argument
from hf_specdec.models.gemma4 import (
    CandidateLogits,
    DenseTargetKVSource,
    Gemma4MTPAssistant,
    producer_layer_for,
    target_embedding,
)
from hf_specdec.models.gemma4.assistant import last_valid
from tests.models.gemma4.helpers import F, S, assistant_config_dict, hf_assistant
from tests.tiny_models import gemma4_31b_style, gemma4_e2b_style

TARGETS = {
    "e2b_style": lambda: gemma4_e2b_style(vocab_size=96, vocab_size_per_layer_input=96),
    "31b_style": lambda: gemma4_31b_style(vocab_size=96),
}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request):
    return TARGETS[request.param]()


@pytest.fixture(params=[False, True], ids=["tied_head", "centroid_head"])
def ordered(request):
    return request.param


@pytest.fixture
def pair(target, ordered, monkeypatch, tmp_path):
    """(transformers' assistant, ours loaded from its save_pretrained), with trained-like random weights."""
    hf = hf_assistant(assistant_config_dict(target.config, ordered), monkeypatch)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(torch.rand_like(param) + 0.5 if "norm" in name else torch.randn_like(param) * 0.3)
        for layer in hf.model.layers:
            layer.layer_scalar.fill_(0.7)
        if ordered:
            hf.masked_embedding.token_ordering.copy_(torch.randperm(hf.vocab_size))
    hf.save_pretrained(tmp_path)
    return hf, Gemma4MTPAssistant.from_pretrained(tmp_path).eval()


def hf_step(hf, target, token, hidden, position, kv, mask):
    """One step exactly as transformers' SinglePositionMultiTokenCandidateGenerator runs it."""
    embeds = torch.cat([target.get_input_embeddings()(token[:, None]), hidden[:, None]], dim=-1)
    out = hf(inputs_embeds=embeds, position_ids=position[:, None], attention_mask=mask, shared_kv_states=kv)
    return out.last_hidden_state[:, 0], out.logits[:, 0]


def assert_same_logits(ours, hf_logits):
    if isinstance(ours, CandidateLogits):
        # transformers fills non-candidates with min(candidates) - 1; the candidate sets must agree exactly.
        hf_candidates = hf_logits > hf_logits.min(dim=-1, keepdim=True).values
        assert torch.equal(torch.zeros_like(hf_candidates).scatter(-1, ours.token_ids, True), hf_candidates)
        torch.testing.assert_close(ours.logits, hf_logits.gather(-1, ours.token_ids), rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(ours.logits, hf_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.argmax(), hf_logits.argmax(-1))


def random_target_kv(text, batch: int, seq: int, gen: torch.Generator) -> dict:
    """Random K/V shaped like the target's producer layers: {layer_type: (keys, values)}."""
    kv = {}
    for layer_type in (S, F):
        layer = text.per_layer_config[producer_layer_for(text, layer_type)]
        shape = (batch, layer.num_key_value_heads, seq, layer.head_dim)
        kv[layer_type] = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    return kv


@torch.no_grad()
def test_one_step_matches_transformers_on_left_padded_batch(pair, target):
    hf, ours = pair
    text = target.config
    gen = torch.Generator().manual_seed(0)
    batch, seq = 3, 2 * text.sliding_window + 3  # longer than the window, so sliding layers see a suffix
    kv = random_target_kv(text, batch, seq, gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, :5], mask[2, : seq - 3] = 0, 0  # left padding: row 2 is shorter than the window
    position = mask.sum(-1)  # the draft position is right after the accepted context
    token, hidden = torch.randint(0, 96, (batch,), generator=gen), torch.randn(batch, text.hidden_size, generator=gen)

    want_hidden, want_logits = hf_step(hf, target, token, hidden, position, kv, mask)
    got = ours.draft_step(token, hidden, position, target_embedding(target), DenseTargetKVSource(kv, mask))
    torch.testing.assert_close(got.hidden_next, want_hidden, rtol=1e-5, atol=1e-5)
    assert_same_logits(got.logits, want_logits)


@torch.no_grad()
def test_draft_round_after_prefill_matches_transformers(pair, target):
    """k steps from a real target prefill: hidden_states[-1] at step 0, post_projection feedback, fixed position."""
    hf, ours = pair
    prompt = torch.randint(3, 96, (1, 2 * target.config.sliding_window + 5), generator=torch.Generator().manual_seed(2))
    cache = DynamicCache()
    out = target(prompt, **{cache_argument(target): cache}, output_hidden_states=True, return_shared_kv_states=True)
    source = DenseTargetKVSource.from_cache(cache, target.config)
    for layer_type, (keys, values) in (out.shared_kv_states or {}).items():  # empty for 31B-style in 5.2x
        assert torch.equal(source.kv[layer_type][0], keys) and torch.equal(source.kv[layer_type][1], values)

    # Step 0 is fed the hidden state the target's LM head reads, i.e. after the final norm.
    cap = target.config.final_logit_softcapping
    head_input = out.hidden_states[-1]
    torch.testing.assert_close(cap * torch.tanh(target.lm_head(head_input) / cap), out.logits)
    token = out.logits[:, -1].argmax(-1)  # the target's next token: fed at position len(prompt)
    position = torch.tensor([prompt.shape[1]])
    hf_token, hf_hidden = token, out.hidden_states[-1][:, -1]
    our_token, our_hidden = token, out.hidden_states[-1][:, -1]
    for _ in range(3):
        hf_hidden, hf_logits = hf_step(hf, target, hf_token, hf_hidden, position, source.kv, None)
        hf_token = hf_logits.argmax(-1)
        step = ours.draft_step(our_token, our_hidden, position, target_embedding(target), source)
        our_token, our_hidden = step.logits.argmax(), step.hidden_next
        assert torch.equal(our_token, hf_token)
        torch.testing.assert_close(our_hidden, hf_hidden, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_final_logit_softcap_is_applied(pair, target):
    """transformers' assistant ignores text_config.final_logit_softcapping (null when released); we apply it."""
    _, ours = pair
    gen = torch.Generator().manual_seed(4)
    source = DenseTargetKVSource(random_target_kv(target.config, 2, 7, gen))
    inputs = (torch.tensor([5, 9]), torch.randn(2, target.config.hidden_size, generator=gen), torch.tensor([7, 7]))
    plain = ours(*inputs, target_embedding(target), source).logits
    ours.config.text_config.final_logit_softcapping = 2.0
    capped = ours(*inputs, target_embedding(target), source).logits
    torch.testing.assert_close(capped.logits, 2.0 * torch.tanh(plain.logits / 2.0))
    assert capped.logits.abs().max() < 2.0 < plain.logits.abs().max()
    assert torch.equal(capped.argmax(), plain.argmax())


@torch.no_grad()
def test_stale_entries_are_invisible():
    """Masked-out K/V entries (rejected drafts) give exactly the output of K/V that never had them."""
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 1, 4, 8, generator=gen)
    kv = {t: (torch.randn(2, 2, 12, 8, generator=gen), torch.randn(2, 2, 12, 8, generator=gen)) for t in (S, F)}
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[:, 9:] = False
    truncated = {t: (k[:, :, :9], v[:, :, :9]) for t, (k, v) in kv.items()}
    for layer_type, window in ((F, None), (S, 5)):
        with_stale = DenseTargetKVSource(kv, mask).attend(layer_type, query, scaling=1.0, sliding_window=window)
        clean = DenseTargetKVSource(truncated).attend(layer_type, query, scaling=1.0, sliding_window=window)
        torch.testing.assert_close(with_stale, clean, rtol=0, atol=1e-6)
        fresh = DenseTargetKVSource(kv).attend(layer_type, query, scaling=1.0, sliding_window=window)
        assert not torch.allclose(fresh, clean)


def test_last_valid_keeps_the_last_window_accepted_entries():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    expected = torch.tensor([[0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(last_valid(mask, 3), expected)
