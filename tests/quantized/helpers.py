"""Quantized tiny targets on the CPU, and the decoding modes the tests run them in.

FP8: transformers quantizes only on a GPU, so the targets here are built as its fine-grained quantizer leaves
them after loading (``fp8_quantize_model``: ``FP8Linear`` / ``FP8Experts`` holding e4m3 weights and block scales),
or as a compressed-tensors FP8 checkpoint loads (``CompressedTensorsFP8Linear``, per-channel scales). 4-bit
targets load through transformers' own quantizers (bitsandbytes NF4, torchao int4 weight-only), which run on
the CPU. Every target is compared with its own plain decoding: the same quantized model, the same layers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import transformers

import hf_specdec
from hf_specdec.assets import asset_path
from hf_specdec.generation.quantization import fp8_quantize_model
from hf_specdec.kernels.fp8_gemm import quantize_fp8

BLOCK = (128, 128)  # the fine-grained format's blocks
NEW_TOKENS = 24
MODES = {  # mode -> (model family, generate kwargs without the drafter)
    "gemma_mtp": ("gemma", dict(num_speculative_tokens=4)),
    "gemma_dflash": ("gemma", dict(spec_mode="dflash")),
    "step_mtp": ("step", dict(spec_mode="mtp", num_speculative_tokens=3)),
}


def load_bundled(name: str, **kwargs):
    """A fresh copy of a bundled tiny model in fp32, not enabled (transformers' loader)."""
    return transformers.AutoModelForCausalLM.from_pretrained(asset_path(name), dtype=torch.float32, **kwargs)


@functools.lru_cache(maxsize=None)
def bundled_drafters():
    """(Gemma 4 MTP assistant, DFlash drafter) of tiny-gemma4, dense fp32."""
    return tuple(hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path(name), dtype=torch.float32)
                 for name in ("tiny-gemma4-assistant", "tiny-gemma4-dflash"))


@functools.lru_cache(maxsize=None)
def bundled_fp8(family: str):
    """The enabled FP8 copy of tiny-gemma4 or tiny-step3p5 (128 x 128 block scales)."""
    name = {"gemma": "tiny-gemma4", "step": "tiny-step3p5"}[family]
    return hf_specdec.enable(fp8_quantize_model(load_bundled(name), BLOCK))


def speculative_kwargs(mode: str) -> dict:
    family, kwargs = MODES[mode]
    if family == "step":
        return dict(kwargs)
    assistant, drafter = bundled_drafters()
    return dict(kwargs, assistant_model=assistant if mode == "gemma_mtp" else drafter)


def greedy(model, ids, mask, new_tokens: int = NEW_TOKENS, **kwargs) -> torch.Tensor:
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                          **kwargs)


def compressed_fp8_model(model: nn.Module) -> nn.Module:
    """``model`` (in place) as a compressed-tensors FP8 checkpoint (channel strategy) loads with
    ``CompressedTensorsConfig(run_compressed=True)``: every ``nn.Linear`` but the LM head a
    ``CompressedTensorsFP8Linear`` with an e4m3 weight and fp32 ``weight_scale`` [1, N], on the device of the layer it
    replaces."""
    from transformers.integrations.compressed_tensors import CompressedTensorsFP8Linear

    head = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or module is head:
            continue
        layer = CompressedTensorsFP8Linear(module.in_features, module.out_features, has_bias=module.bias is not None)
        layer.to(module.weight.device)
        weight, scale = quantize_fp8(module.weight.detach(), None)
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.weight_scale.copy_(scale.reshape(1, -1))
            if module.bias is not None:
                layer.bias.copy_(module.bias)
        model.set_submodule(name, layer)
    return model
