"""The "hf_specdec" experts function: enable selects it for MoE models whose experts use transformers' experts
interface, disable restores what was there, and where the kernels do not run it is the model's previous
implementation exactly."""

import pytest
import torch

import hf_specdec
from hf_specdec.generation import experts as experts_module
from tests.tiny_models import gemma4_26b_style, gemma4_31b_style, left_padded_batch


def test_enable_selects_the_fused_experts_and_disable_restores_the_previous_ones():
    model = gemma4_26b_style()
    before = model.get_experts_implementation()
    hf_specdec.enable(model)
    assert model.get_experts_implementation() == {"": experts_module.EXPERTS_NAME}
    moe = [m for m in model.modules() if type(m).__name__ == "Gemma4TextExperts"]
    assert moe and all(experts_module.fused_weights(m) is not None for m in moe)
    hf_specdec.disable(model)
    assert model.get_experts_implementation() == before
    assert not any(experts_module._FALLBACK in vars(m) for m in moe)


def test_a_dense_model_keeps_its_experts_setting():
    model = hf_specdec.enable(gemma4_31b_style())
    assert model._hf_specdec.original_experts is None
    hf_specdec.disable(model)


def test_on_cpu_the_experts_are_the_models_own():
    """Logits of an enabled MoE model's plain forward equal the un-enabled model's bit for bit (the fallback is
    the implementation the model had), and its greedy decoding is transformers'."""
    ref, ours = gemma4_26b_style(), hf_specdec.enable(gemma4_26b_style())
    ids, mask = left_padded_batch([9, 4, 7])
    with torch.no_grad():
        assert torch.equal(ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_experts_the_kernel_does_not_cover_run_the_previous_implementation(monkeypatch):
    """A module the fused kernel would compute differently (here: a ReLU gate) takes the previous
    implementation even where the kernels run."""
    model = hf_specdec.enable(gemma4_26b_style())
    experts = next(m for m in model.modules() if type(m).__name__ == "Gemma4TextExperts")
    monkeypatch.setattr(experts, "act_fn", torch.nn.ReLU())
    assert experts_module.fused_weights(experts) is None
    monkeypatch.setattr(experts_module, "use_triton", lambda tensor: True)
    monkeypatch.setattr(experts_module, "fused_moe", lambda *a, **k: pytest.fail("the kernel ran"))
    x = torch.randn(3, model.config.hidden_size)
    index, weights = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.rand(3, 2)
    expected = type(experts).forward.__wrapped__(experts, x, index, weights)
    with torch.no_grad():
        got = experts(x, index, weights)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("variant", ["own_gate", "post_expert_norm"])
def test_experts_with_their_own_gate_or_a_norm_after_each_expert_are_not_fused(variant, monkeypatch):
    """What use_experts_implementation lets a model change and fused_moe does not compute (a class's _apply_gate,
    e.g. a clamped SwiGLU; a norm after each expert) keeps the model's implementation."""
    model = gemma4_26b_style()
    experts = next(m for m in model.modules() if type(m).__name__ == "Gemma4TextExperts")
    assert experts_module.fused_weights(experts) is not None
    if variant == "own_gate":
        monkeypatch.setattr(type(experts), "_apply_gate", lambda self, gate_up: gate_up.chunk(2, -1)[1], raising=False)
    else:
        monkeypatch.setattr(experts, "has_post_expert_norm", True, raising=False)
    assert experts_module.fused_weights(experts) is None
