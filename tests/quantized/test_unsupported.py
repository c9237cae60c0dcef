"""What hf_specdec refuses, naming what it supports: a target in a weight format it does not decode through
(GPTQ / AWQ / HQQ-style packed layers, FP4-packed FP8Linear, another quantizer's config), and a quantized drafter
(drafters run in the dtype they are loaded in)."""

import pytest
import torch
import torch.nn as nn
from transformers.integrations.finegrained_fp8 import FP8Linear

import hf_specdec
from hf_specdec.generation.quantization import (
    UnsupportedWeights,
    check_drafter_weights,
    check_target_weights,
    fp8_quantize_model,
    weight_format,
)
from tests.models.dflash.helpers import random_drafter
from tests.models.gemma4.helpers import assistant_config_dict, random_state_dict, released_layout, write_checkpoint
from tests.quantized.helpers import bundled_drafters
from tests.tiny_models import gemma4_31b_style, left_padded_batch, llama

SUPPORTED = r"supports dense weights .*FP8 weights .*bitsandbytes .*torchao"


class PackedQuantLinear(nn.Module):
    """The shape of GPTQ / AWQ / Marlin layers: packed int32 ``qweight``, ``scales``, ``qzeros``."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.register_buffer("qweight", torch.zeros(in_features // 8, out_features, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(1, out_features // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.ones(1, out_features))
        self.out_features = out_features

    def forward(self, x):
        return x.new_zeros(*x.shape[:-1], self.out_features)


def _packed_target():
    model = llama()
    model.model.layers[0].mlp.down_proj = PackedQuantLinear(64, 32)
    return model


def test_dense_and_supported_formats_are_named():
    assert weight_format(llama()) == "dense"
    assert check_target_weights(fp8_quantize_model(llama(), (16, 16))) == "fp8"
    assistant, drafter = bundled_drafters()
    check_drafter_weights(assistant)  # the bundled drafters are dense (a centroid head's int buffers included)
    check_drafter_weights(drafter)


def test_a_packed_integer_target_is_refused_naming_the_layer_and_the_supported_formats():
    with pytest.raises(UnsupportedWeights, match=r"packed integer layers \(PackedQuantLinear at "
                                                 r"'model.layers.0.mlp.down_proj'\)\. It " + SUPPORTED):
        check_target_weights(_packed_target())


@pytest.mark.parametrize("method", ["gptq", "awq", "hqq", "gguf", "mxfp4"])
def test_another_quantizers_config_is_refused(method):
    model = llama()
    model.config.quantization_config = {"quant_method": method, "bits": 4}
    with pytest.raises(UnsupportedWeights, match=rf"does not decode {method}-quantized targets\. It {SUPPORTED}"):
        weight_format(model)


def test_fp4_packed_fp8_linear_is_refused():
    """transformers' FP8Linear also holds FP4 weights packed two per int8 (expert_dtype="fp4" checkpoints):
    hf_specdec's FP8 kernels read e4m3 only."""
    model = llama()
    layer = FP8Linear(32, 64, block_size=(16, 16))
    layer.weight = nn.Parameter(torch.zeros(64, 16, dtype=torch.int8), requires_grad=False)
    model.model.layers[1].mlp.up_proj = layer
    with pytest.raises(UnsupportedWeights, match=r"FP4-packed layers \(FP8Linear at 'model.layers.1.mlp.up_proj'\)"):
        weight_format(model)


def test_bitsandbytes_8_bit_with_outlier_decomposition_is_refused_naming_the_setting(tmp_path):
    """LLM.int8() computes the outlier columns of the whole forward apart: a token's product depends on the other
    tokens, so a verify and a decode step differ. With llm_int8_threshold=0.0 it runs (test_four_bit_targets)."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
    from transformers import BitsAndBytesConfig

    llama().save_pretrained(tmp_path / "m")
    model = type(llama()).from_pretrained(tmp_path / "m", quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                          dtype=torch.float32, device_map="cpu")
    with pytest.raises(UnsupportedWeights, match=r"bitsandbytes 8-bit outlier layers .*llm_int8_threshold=0\.0\)\. "
                                                 r"It " + SUPPORTED):
        weight_format(model)


def test_torchao_activation_quantization_is_refused():
    pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    model = llama()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    with pytest.raises(UnsupportedWeights, match=r"torchao activation-quantized layers .*use a weight-only config"):
        weight_format(model)
    weight_only = llama()
    quantize_(weight_only, Int8WeightOnlyConfig())
    assert weight_format(weight_only) == "torchao"


def _assistant(tmp_path, target):
    config = assistant_config_dict(target.config, True)
    return hf_specdec.AutoModelForCausalLM.from_pretrained(
        write_checkpoint(tmp_path / "assistant", config, random_state_dict(released_layout(config))))


def test_a_quantized_assistant_is_refused_naming_the_fix(tmp_path):
    target = gemma4_31b_style(vocab_size=96)
    assistant = fp8_quantize_model(_assistant(tmp_path, target), (16, 16))
    with pytest.raises(UnsupportedWeights, match=r"assistant_model has quantized weights \(fp8: FP8Linear at "
                                                 r"'[\w.]+'\); drafters run in the dtype they are loaded in: load it "
                                                 r"without quantization_config.*The target may be quantized"):
        check_drafter_weights(assistant)
    check_drafter_weights(_assistant(tmp_path, target))  # dense: accepted


def test_a_quantized_dflash_drafter_is_refused():
    drafter = random_drafter(gemma4_31b_style())
    drafter.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(UnsupportedWeights, match=r"quantization_config bitsandbytes"):
        check_drafter_weights(drafter)


def test_enable_refuses_an_unsupported_target():
    model = _packed_target()
    with pytest.raises(UnsupportedWeights, match=SUPPORTED):
        hf_specdec.enable(model)
    assert getattr(model, "_hf_specdec", None) is None  # refused before anything changed


def test_generate_refuses_a_quantized_assistant(tmp_path):
    target = hf_specdec.enable(gemma4_31b_style(vocab_size=96))
    assistant = fp8_quantize_model(_assistant(tmp_path, target), (16, 16))
    ids, mask = left_padded_batch([5, 3], vocab=96)
    with pytest.raises(UnsupportedWeights, match="assistant_model has quantized weights"):
        target.generate(ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=3)
