"""FP8 targets in every speculative mode: greedy output equals the same FP8 model's own plain greedy output
(invariant 1, batches with left padding, prompts and outputs past the sliding windows), sampled output follows its
distribution (invariant 4), and ``enable`` / ``disable`` swap the FP8 layers' forwards in and out. On the CPU the
layers compute the weight-only product; their W8A8 product on GPUs with FP8 tensor cores is checked by
``tests/runtime/test_batch_invariance.py``.

The bundled tiny family, quantized to FP8, keeps its drafters' real acceptance, so rounds mix full, partial and
no acceptance; the random tiny configs of ``tests/tiny_models.py`` add each architecture's quirks (KV-shared
layers, attention_k_eq_v, a mixture of experts whose experts are ``FP8Experts``).
"""

import copy

import pytest
import torch
import torch.nn as nn
from transformers.integrations.compressed_tensors import CompressedTensorsFP8Linear
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

import hf_specdec
from hf_specdec.generation.quantization import fp8_quantize_model, weight_format
from hf_specdec.kernels.fp8_gemm import dequantize_fp8
from hf_specdec.kernels.fp8_w8a8 import fp8_linear_forward
from hf_specdec.kernels.fp8_moe import fp8_experts_forward
from tests.bundled import batch
from tests.distribution import assert_follows, second_token_marginal, second_tokens_of_sampled_mtp
from tests.models.dflash.helpers import random_drafter
from tests.models.gemma4.helpers import assistant_config_dict, random_state_dict, released_layout, write_checkpoint
from tests.models.step3p5.tiny_step3p5 import tiny_model as tiny_step
from tests.quantized.helpers import (
    MODES,
    bundled_fp8,
    compressed_fp8_model,
    greedy,
    speculative_kwargs,
)
from tests.tiny_models import gemma4_26b_style, gemma4_31b_style, gemma4_e2b_style, left_padded_batch

VOCAB = 96  # divisible by the assistants' centroid count
TARGETS = {"e2b": gemma4_e2b_style, "31b": gemma4_31b_style, "26b": gemma4_26b_style}
GEMMA_DRAFTER = dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=6)


def _assistant(tmp_path, target, ordered=True, seed=0, **text):
    config = assistant_config_dict(target.config, ordered, **text)
    path = write_checkpoint(tmp_path / f"assistant-{ordered}-{seed}", config,
                            random_state_dict(released_layout(config), seed))
    return hf_specdec.AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("mode", list(MODES))
def test_bundled_fp8_target_greedy_equals_its_plain_greedy(mode):
    """tiny-gemma4 / tiny-step3p5 in FP8 with their dense drafters: lossless, and the drafters still accept."""
    target = bundled_fp8(MODES[mode][0])
    assert weight_format(target) == "fp8" and target.get_input_embeddings().weight.dtype == torch.float32
    ids, mask = batch(4)
    plain = greedy(target, ids, mask)
    assert hf_specdec.last_generation_stats(target).spec_mode is None
    got = greedy(target, ids, mask, **speculative_kwargs(mode))
    assert torch.equal(got, plain)
    stats = hf_specdec.last_generation_stats(target)
    assert stats.num_generated_tokens == 4 * 24 and stats.mean_accepted_length > 1.5, stats


@pytest.mark.parametrize("style,ordered,k", [("31b", True, 3), ("e2b", False, 8), ("26b", False, 1)])
def test_tiny_fp8_targets_with_the_mtp_assistant(tmp_path, style, ordered, k):
    """The assistant (dense, fp32) reads the FP8 target's embedding, pages and last hidden state."""
    target = hf_specdec.enable(fp8_quantize_model(TARGETS[style](vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB),
                                                  (16, 16)))
    assert any(isinstance(m, FP8Experts) for m in target.modules()) == (style == "26b")
    assistant = _assistant(tmp_path, target, ordered)
    ids, mask = left_padded_batch([13, 4, 9, 6], vocab=VOCAB)  # prompt + output past the window (8)
    plain = greedy(target, ids, mask, 22)
    assert torch.equal(greedy(target, ids, mask, 22, assistant_model=assistant, num_speculative_tokens=k), plain)


@pytest.mark.parametrize("style", ["31b", "26b"])
def test_tiny_fp8_targets_with_a_dflash_drafter(style):
    """The DFlash drafter reads the FP8 target's hidden states, embedding and LM head."""
    target = hf_specdec.enable(fp8_quantize_model(TARGETS[style](), (16, 16)))
    drafter = random_drafter(target, block_size=4, **GEMMA_DRAFTER)
    ids, mask = left_padded_batch([13, 4, 9, 6], seed=1)
    plain = greedy(target, ids, mask, 22)
    assert torch.equal(greedy(target, ids, mask, 22, assistant_model=drafter), plain)
    assert hf_specdec.last_generation_stats(target).spec_mode == "dflash"


def test_tiny_fp8_step3p5_with_its_own_mtp_layers():
    """Step 3.5: FP8 attention, dense MLPs, shared experts and MTP projections; the router (kept in fp32) and the
    routed experts stay dense."""
    model = hf_specdec.enable(fp8_quantize_model(tiny_step(), (16, 16)))
    layer = model.model.layers[3]
    assert isinstance(layer.self_attn.q_proj, FP8Linear) and isinstance(layer.share_expert.down_proj, FP8Linear)
    assert type(layer.moe.gate) is nn.Linear and layer.moe.gate_proj.weight.dtype == torch.float32
    ids, mask = left_padded_batch([11, 3, 8, 6], vocab=64)  # window 5: prompts and outputs past it
    plain = greedy(model, ids, mask, 18)
    for k in (1, 3):
        assert torch.equal(greedy(model, ids, mask, 18, spec_mode="mtp", num_speculative_tokens=k), plain)


def test_compressed_tensors_fp8_target(tmp_path):
    """A compressed-tensors FP8 checkpoint's layers (per-channel scales) in MTP and DFlash modes."""
    target = hf_specdec.enable(compressed_fp8_model(gemma4_31b_style(vocab_size=VOCAB)))
    assert weight_format(target) == "fp8"
    assert all("forward" in vars(m) for m in target.modules() if isinstance(m, CompressedTensorsFP8Linear))
    ids, mask = left_padded_batch([13, 4, 9, 6], vocab=VOCAB)
    plain = greedy(target, ids, mask, 20)
    assistant = _assistant(tmp_path, target)
    assert torch.equal(greedy(target, ids, mask, 20, assistant_model=assistant, num_speculative_tokens=3), plain)
    drafter = random_drafter(target, block_size=4, mask_token_id=VOCAB - 1, **GEMMA_DRAFTER)
    assert torch.equal(greedy(target, ids, mask, 20, assistant_model=drafter), plain)


def test_fp8_plain_decoding_is_the_dequantized_model():
    """What "lossless" is measured against: the FP8 target decodes as the same model with its FP8 weights
    dequantized into dense layers (fp32 on CPU: the same products)."""
    dense = gemma4_31b_style()
    target = hf_specdec.enable(fp8_quantize_model(copy.deepcopy(dense), (16, 16)))
    for name, layer in target.named_modules():
        if isinstance(layer, FP8Linear):
            with torch.no_grad():
                dense.get_submodule(name).weight.copy_(dequantize_fp8(layer.weight, layer.weight_scale_inv, (16, 16)))
    ids, mask = left_padded_batch([13, 4, 9, 6])
    assert torch.equal(greedy(target, ids, mask, 16), greedy(dense, ids, mask, 16))


def test_enable_swaps_the_fp8_forwards_and_disable_restores_them():
    target = fp8_quantize_model(gemma4_26b_style(), (16, 16))
    layers = [m for m in target.modules() if isinstance(m, (FP8Linear, FP8Experts))]
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ImportError):  # transformers' own FP8 forwards need a GPU kernel
        target(ids)
    hf_specdec.enable(target)
    expected = {FP8Linear: fp8_linear_forward, FP8Experts: fp8_experts_forward}
    assert all(vars(m)["forward"].__func__ is expected[type(m)] for m in layers)
    with torch.no_grad():
        logits = target(ids).logits  # a plain forward of the enabled model runs the weight-only product
    hf_specdec.disable(target)
    assert not any("forward" in vars(m) for m in layers)
    hf_specdec.enable(target)
    with torch.no_grad():
        assert torch.equal(target(ids).logits, logits)


def test_sampled_mtp_tokens_of_an_fp8_target_follow_its_distribution(tmp_path):
    """Invariant 4 with an FP8 target: the 2nd generated token (decided by rejection sampling against a random
    centroid-head assistant) has the FP8 target's exact marginal."""
    target = hf_specdec.enable(fp8_quantize_model(gemma4_e2b_style(vocab_size=16, vocab_size_per_layer_input=16),
                                                  (16, 16)))
    assistant = _assistant(tmp_path, target, True, seed=3, num_centroids=4, top_k=2)
    prompt = torch.tensor([[3, 5, 9, 7]])
    samples = second_tokens_of_sampled_mtp(target, assistant, prompt)
    assert_follows(samples, second_token_marginal(target, prompt, 16))  # plain forwards of the enabled target
