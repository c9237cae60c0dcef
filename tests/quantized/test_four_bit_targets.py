"""4-bit targets through transformers' own quantizers on the CPU: bitsandbytes NF4 and torchao int4 weight-only
(and bitsandbytes' 8-bit layers without outlier decomposition; with it, refused: test_unsupported.py).
Their layers keep their own forwards under ``enable``, so hf_specdec's plain greedy output equals transformers'
greedy output on the same quantized model, and every speculative mode equals both (invariant 1).

On CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights at their first forward into a layout that needs
out_features % 32 == 0 and in_features % 64 == 0; the tests turn that repacking off, so the tiny shapes run (and
run alike on every CPU). torchao's groups (32 here) need in_features to be a multiple of the group. torchao's int4 weight-only GPU layouts (tinygemm and the like)
do not run on a CPU; ``IntxWeightOnlyConfig(weight_dtype=torch.int4)`` stores the same group-wise int4 weights in a
layout that does. Each format skips, naming the package, where its package is not installed.
"""

import pytest
import torch

import hf_specdec
from hf_specdec.generation.quantization import weight_format
from tests.models.dflash.helpers import random_drafter
from tests.models.gemma4.helpers import assistant_config_dict, random_state_dict, released_layout, write_checkpoint
from tests.models.step3p5.tiny_step3p5 import tiny_model as tiny_step
from tests.bundled import batch
from tests.quantized.helpers import MODES, greedy, load_bundled, speculative_kwargs
from tests.tiny_models import gemma4_31b_style, left_padded_batch

VOCAB = 96
S = "sliding_attention"
GEMMA_DRAFTER = dict(layer_types=[S, "full_attention"], use_sliding_window=True, sliding_window=6)
STEP_SHAPE = dict(hidden_size=64, intermediate_size=128, head_dim=32, share_expert_dim=64,
                  attention_other_setting={"attention_type": S, "num_attention_heads": 4, "num_attention_groups": 1,
                                           "head_dim": 16})


def nf4_config(skip):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                              llm_int8_skip_modules=skip)


def int8_config(skip):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0, llm_int8_skip_modules=skip)


def int4_config(skip):
    pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup
    from transformers import TorchAoConfig

    return TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
                         modules_to_not_convert=skip)


FORMATS = {"nf4": (nf4_config, "bitsandbytes"), "int4": (int4_config, "torchao"),
           "bnb_int8": (int8_config, "bitsandbytes")}


def quantized(tmp_path, model, weights: str, skip: list[str] | None = None):
    """``model`` saved and loaded back through transformers' quantizer for ``weights`` (``skip``: modules to keep
    dense instead of the quantizer's defaults), not enabled."""
    make_config, _ = FORMATS[weights]
    config = make_config(skip)
    path = tmp_path / weights
    model.save_pretrained(path)
    loaded = type(model).from_pretrained(path, quantization_config=config, dtype=torch.float32, device_map="cpu")
    for module in loaded.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return loaded


@pytest.mark.parametrize("weights", list(FORMATS))
def test_gemma4_target_in_4_bits_with_its_assistant_and_a_dflash_drafter(tmp_path, weights):
    target = quantized(tmp_path, gemma4_31b_style(vocab_size=VOCAB, hidden_size=64, intermediate_size=128), weights)
    assert weight_format(target) == FORMATS[weights][1]
    assert target.get_input_embeddings().weight.dtype == torch.float32  # the assistant's shared embedding
    ids, mask = left_padded_batch([13, 4, 9, 6], vocab=VOCAB)
    expected = greedy(target, ids, mask, 20)  # transformers' own decoding of the quantized model
    hf_specdec.enable(target)
    assert torch.equal(greedy(target, ids, mask, 20), expected)
    config = assistant_config_dict(target.config, True)
    assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(
        write_checkpoint(tmp_path / "assistant", config, random_state_dict(released_layout(config))))
    assert torch.equal(greedy(target, ids, mask, 20, assistant_model=assistant, num_speculative_tokens=3), expected)
    drafter = random_drafter(target, block_size=4, mask_token_id=VOCAB - 1, **GEMMA_DRAFTER)
    assert torch.equal(greedy(target, ids, mask, 20, assistant_model=drafter), expected)


@pytest.mark.parametrize("weights", list(FORMATS))
def test_step3p5_target_in_4_bits_with_its_own_mtp_layers(tmp_path, weights):
    """Step 3.5's router reads its weight in fp32 itself (not through the layer): it stays dense, as the README
    says to load it."""
    model = quantized(tmp_path, tiny_step(**STEP_SHAPE), weights, skip=["moe.gate", "lm_head"])
    assert weight_format(model) == FORMATS[weights][1]
    assert type(model.model.layers[3].moe.gate) is torch.nn.Linear
    ids, mask = left_padded_batch([11, 3, 8, 6], vocab=64)
    expected = greedy(model, ids, mask, 18)
    hf_specdec.enable(model)
    assert torch.equal(greedy(model, ids, mask, 18), expected)
    assert torch.equal(greedy(model, ids, mask, 18, spec_mode="mtp", num_speculative_tokens=3), expected)


@pytest.mark.parametrize("weights", ["nf4", "int4"])
@pytest.mark.parametrize("mode", ["gemma_mtp", "gemma_dflash", "step_mtp"])
def test_bundled_4_bit_target_accepts_drafts_and_equals_its_plain_greedy(tmp_path, weights, mode):
    """The bundled tiny family in 4 bits with its trained drafters: verify forwards of several tokens per row through
    the 4-bit layers give plain decoding's tokens while drafts are really accepted (the random-drafter tests above
    reject almost every draft)."""
    family = MODES[mode][0]
    # Step 3.5's router stays dense (as the README says); tiny-gemma4's per-layer projections read 16 inputs, less
    # than one int4 group of 32
    skip = (["moe.gate", "lm_head"] if family == "step"
            else [f"model.layers.{i}.per_layer_projection" for i in range(8)] + ["lm_head"])
    name = {"gemma": "tiny-gemma4", "step": "tiny-step3p5"}[family]
    target = hf_specdec.enable(quantized(tmp_path, load_bundled(name), weights, skip=skip))
    assert weight_format(target) == FORMATS[weights][1]
    ids, mask = batch(4)
    plain = greedy(target, ids, mask)
    assert torch.equal(greedy(target, ids, mask, **speculative_kwargs(mode)), plain)
    assert hf_specdec.last_generation_stats(target).mean_accepted_length > 1.5


@pytest.mark.parametrize("weights", ["nf4", "int4"])
def test_4_bit_layers_keep_their_own_forwards_where_the_kernels_run(tmp_path, weights, monkeypatch):
    """Where the fused kernels run (CUDA; forced here), ``enable`` stacks same-input projections and gives plain
    ``nn.Linear`` layers the skinny GEMM: a 4-bit layer, whether its class is bitsandbytes' own or an ``nn.Linear``
    holding a torchao tensor, must be left to its own forward and weights (stacking torchao's int4 weights failed
    with "invalid python storage" at enable on a GPU)."""
    from hf_specdec.generation.fusion import FORCE_TRITON_ENV, fuse_modules

    target = quantized(tmp_path, gemma4_31b_style(vocab_size=VOCAB, hidden_size=64, intermediate_size=128), weights)
    before = {name: p for name, p in target.named_parameters()}
    quantized_linears = [m for m in target.modules() if isinstance(m, torch.nn.Linear) and weight_format(m) != "dense"]
    assert quantized_linears
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    assert fuse_modules(target, kernels=True) > 0  # the norms and dense layers around them still fuse
    assert not any("forward" in vars(m) for m in quantized_linears)
    assert all(p is before[name] for name, p in target.named_parameters())
