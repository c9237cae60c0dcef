"""Quantized targets: which weight formats hf_specdec decodes through, and the checks that name them.

The loop, the paged cache and the drafters never read a target's linear weights themselves: a projection runs
as its module (or a fused forward of ``generation/fusion.py``), so a target whose linears are quantized decodes
through the same loop in every mode. What changes is who computes the product:

    format         loaded with (transformers)                         the layers' forward under enable
    dense          dtype=bf16 / fp16 / fp32                          the fused forwards (skinny GEMM on CUDA)
    fp8            FineGrainedFP8Config, or a compressed-tensors     on GPUs with FP8 tensor cores, W8A8 as the
                   FP8 checkpoint (CompressedTensorsFP8Linear)       layers' own forwards compute it
                                                                     (kernels/fp8_w8a8.py, experts fp8_moe.py);
                                                                     elsewhere weight-only FP8 GEMMs reading the
                                                                     e4m3 bytes and scales (kernels/fp8_gemm.py)
    bitsandbytes   BitsAndBytesConfig (NF4 / FP4; 8-bit with         the layers' own (bitsandbytes' kernels)
                   llm_int8_threshold=0.0)
    torchao        TorchAoConfig, weight-only configs                the layers' own (torchao's tensor subclasses)
                   (Int4WeightOnlyConfig, IntxWeightOnlyConfig, ...)

The drafters read what the target exposes unquantized in every format: its input embedding (the Gemma 4
assistant's shared embedding, DFlash's block embeddings), its LM head (transformers' quantizers leave both
dense), and its hidden states and K/V pages (activations, in the activation dtype).

Greedy output of a quantized target equals its own plain greedy output through hf_specdec: plain, verify and
draft forwards run the same layer forwards, and in every supported format a token's product depends on that
token alone. Formats where it depends on the other tokens of a forward are refused: bitsandbytes' 8-bit layers
with an outlier threshold (LLM.int8() computes apart the columns where any token of the forward has an outlier,
so a verify of k+1 tokens and a one-token decode round a token differently) and torchao tensors that quantize
the activations. FP8 layers quantize each row's activations with that row's own scales (W8A8, as transformers'
layers do) where the GPU has FP8 tensor cores, and keep them unquantized elsewhere (the weight-only product: on the
CPU, torch's one-row and several-row kernels differ in last bits that quantized activations would magnify).

Drafters run in the dtype they are loaded in; a quantized drafter is refused (:func:`check_drafter_weights`),
as is a target in any other format (:func:`weight_format`): GPTQ, AWQ, HQQ, quanto, GGUF, FP4, ... Both errors
name the supported formats.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hf_specdec.kernels._dispatch import needs_grad
from hf_specdec.kernels.fp8_gemm import FP8_DTYPE, MAX_KERNEL_ROWS, quantize_fp8
from hf_specdec.kernels.fp8_moe import experts_input_group
from hf_specdec.kernels.fp8_w8a8 import activations_quantized, fp8_linear_input_group

SUPPORTED = ("dense", "fp8", "bitsandbytes", "torchao")
# transformers' quantization_config.quant_method -> the format it loads as
_METHODS = {"fp8": "fp8", "compressed-tensors": "fp8", "bitsandbytes": "bitsandbytes", "torchao": "torchao"}
# attributes of packed integer layers (GPTQ / AWQ / Marlin / EETQ qweight, HQQ W_q, compressed-tensors packs)
_PACKED = ("qweight", "W_q", "weight_packed", "qzeros")
SUPPORTED_TEXT = ("dense weights (bf16, fp16, fp32); FP8 weights (transformers' FineGrainedFP8Config, "
                  "compressed-tensors FP8 checkpoints); bitsandbytes 4-bit (NF4, FP4) and 8-bit with "
                  "llm_int8_threshold=0.0 (BitsAndBytesConfig); torchao weight-only tensors (TorchAoConfig)")
# why a format that runs is still refused: a token's product would depend on the other tokens of the forward
_HINTS = {
    "bitsandbytes 8-bit outlier": " LLM.int8() computes apart the columns where any token of the forward has an "
                                  "outlier, so a verify step and a decode step would round a token differently; "
                                  "load with BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0).",
    "torchao activation-quantized": " Quantized activations may take their scales from several tokens of a "
                                    "forward (per-tensor granularity); use a weight-only config "
                                    "(Int4WeightOnlyConfig, IntxWeightOnlyConfig, ...).",
}


# False: norms never quantize their outputs for the FP8 products after them (read at each call: an A/B knob, with the
# CUDA graphs captured before it released)
NORM_CODES = True


class UnsupportedWeights(ValueError):
    """A model whose weight format hf_specdec does not decode through (a ``ValueError``)."""


def weight_format(model: nn.Module) -> str:
    """The weight format of ``model``'s layers, one of :data:`SUPPORTED` (joined by "+" if it mixes two); raises
    :class:`UnsupportedWeights` naming the supported ones for anything else. Read from transformers'
    ``quantization_config`` and from the modules themselves (a model quantized by hand has no config)."""
    method = _quant_method(model)
    if method is not None and method not in _METHODS:
        raise UnsupportedWeights(f"hf_specdec does not decode {method}-quantized targets. It supports "
                                 f"{SUPPORTED_TEXT}; load the model in one of these formats, or use it without "
                                 "hf_specdec.enable.")
    layers = quantized_layers(model)
    for kind, name, cls in layers:
        if kind not in SUPPORTED:
            raise UnsupportedWeights(f"hf_specdec does not decode targets with {kind} layers ({cls} at '{name}')."
                                     f"{_HINTS.get(kind, '')} It supports {SUPPORTED_TEXT}; load the model in one of "
                                     "these formats, or use it without hf_specdec.enable.")
    return "+".join(sorted({kind for kind, _, _ in layers})) or "dense"


def quantized_layers(model: nn.Module) -> list[tuple[str, str, str]]:
    """(format, module name, class name) of every module of ``model`` whose own weights are not dense."""
    layers = []
    for name, module in model.named_modules():
        kind = _module_format(module)
        if kind is not None:
            layers.append((kind, name, type(module).__name__))
    return layers


def check_target_weights(model: nn.Module) -> str:
    """``enable``'s check: the target's weight format (:func:`weight_format`), or UnsupportedWeights."""
    return weight_format(model)


def check_drafter_weights(drafter, argument: str = "assistant_model") -> None:
    """A drafter model (Gemma 4 assistant, DFlash drafter) must hold dense weights: its draft steps call fused
    kernels on its own weights and feed the target's hidden states through them. Raises
    :class:`UnsupportedWeights` naming the fix."""
    if not isinstance(drafter, nn.Module):
        return
    method = _quant_method(drafter)
    layers = quantized_layers(drafter)
    if method is None and not layers:
        return
    kind, name, cls = layers[0] if layers else (method, None, None)
    where = f"{kind}: {cls} at '{name}'" if name is not None else f"quantization_config {kind}"
    raise UnsupportedWeights(
        f"{argument} has quantized weights ({where}); drafters run in the dtype they are loaded in: load it "
        "without quantization_config, in the target's activation dtype (from_pretrained(..., "
        f"dtype=torch.bfloat16)). The target may be quantized: hf_specdec supports targets with {SUPPORTED_TEXT}.")


def _quant_method(model: nn.Module) -> str | None:
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def _module_format(module: nn.Module) -> str | None:
    """The format of one module's own weights: a SUPPORTED entry, None for dense or weightless modules, or a
    description of an unsupported one."""
    cls = type(module)
    if cls.__module__.startswith("bitsandbytes"):
        threshold = getattr(getattr(module, "state", None), "threshold", 0.0) or 0.0
        return "bitsandbytes 8-bit outlier" if threshold > 0 else "bitsandbytes"
    if cls.__name__ in ("FP8Linear", "FP8Experts", "CompressedTensorsFP8Linear") and \
            cls.__module__.startswith("transformers"):
        weights = [p for n, p in module.named_parameters(recurse=False) if not n.endswith(("scale", "scale_inv"))]
        packed = [p for p in weights if p.dtype in (torch.int8, torch.uint8)]
        return "FP4-packed" if packed else "fp8"
    if any(isinstance(getattr(module, name, None), torch.Tensor) for name in _PACKED):
        return "packed integer"
    own = list(module.parameters(recurse=False))
    ao = [p for p in own if type(p).__module__.startswith("torchao")]
    if ao:
        quantizes_activations = any(getattr(p, name, None) is not None for p in ao
                                    for name in ("act_quant_kwargs", "activation_quantization"))
        return "torchao activation-quantized" if quantizes_activations else "torchao"
    odd = [p.dtype for p in own if p.dtype == FP8_DTYPE or not (p.is_floating_point() or p.is_complex())]
    return f"{str(odd[0]).removeprefix('torch.')} weight" if odd else None


# ---------------------------------------------------------------- a dense model as transformers' FP8 layers


def w8a8_input_group(x: torch.Tensor, *consumers: nn.Module | None) -> int | None:
    """For a kernel (a norm, a gated activation) about to compute rows like ``x`` (its input, or a tensor of the
    output's shape, dtype and device) that only ``consumers`` read next: the values per scale in which all of them
    quantize those rows, when each one is an FP8 product under ``enable`` that computes W8A8 here in groups
    (fine-grained ``FP8Linear`` with dynamic activations, ``FP8Experts``' grouped kernels), so that the kernel can
    write the codes beside its output (``rms_norm``'s ``quantize_group``) and the products skip their own
    quantizing launch; else None. ``None`` consumers (a projection the layer does not have) are left out. Products
    that quantize whole rows (one scale a row: compressed-tensors checkpoints) keep their own launch: a norm would
    quantize a row in one program, slower than a norm and the products' launch on wide rows (4.6 against 3.3 us for
    5376 values on an H200); so do rows the products would hand to their reference (more than
    ``MAX_KERNEL_ROWS``: a long prefill)."""
    consumers = [m for m in consumers if m is not None]
    k = x.shape[-1]
    if (not NORM_CODES or not consumers or not activations_quantized(x) or needs_grad(x)
            or x.numel() // max(1, k) > MAX_KERNEL_ROWS):
        return None
    groups = {experts_input_group(m, x) if hasattr(m, "gate_up_proj_scale_inv") else fp8_linear_input_group(m, k)
              for m in consumers}
    return groups.pop() if len(groups) == 1 else None


def fp8_quantize_model(model: nn.Module, block_size: tuple[int, int] | None = (128, 128),
                       modules_to_not_convert: list[str] | None = None) -> nn.Module:
    """``model`` (in place) as transformers' fine-grained FP8 quantizer leaves it after loading on a GPU: every
    ``nn.Linear`` becomes an ``FP8Linear`` and every ``*.experts`` module an ``FP8Experts``, holding e4m3 weights
    with per-block scales (``block_size``; None: one scale per tensor) quantized from the dense weights they
    replace. By default the modules transformers keeps dense stay dense (the LM head and tied or last weights,
    the model's keep-in-fp32 modules). For benchmarks and tests of random or dense weights: transformers
    quantizes only on a GPU and only while loading a checkpoint.

    The layers are filled one at a time, each dense weight dropped once its FP8 copy is made, so the peak memory
    is the dense model plus one layer's temporaries (a 31B bf16 model quantizes on one 80 GB GPU)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    if modules_to_not_convert is None:
        keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
        keep += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        modules_to_not_convert = get_keys_to_not_convert(model) + [k.removesuffix(".weight") for k in keep]
    originals = {name: module for name, module in model.named_modules()}
    replace_with_fp8_linear(model, modules_to_not_convert=modules_to_not_convert,
                            quantization_config=FineGrainedFP8Config(weight_block_size=block_size))
    for name, module in list(model.named_modules()):
        original = originals.pop(name, None)
        if module is original or original is None or _module_format(module) != "fp8":
            continue
        device = next(original.parameters()).device
        module.to_empty(device=device)
        with torch.no_grad():
            if name.endswith(".experts"):
                _fill_fp8_experts(module, original, block_size)
            else:
                _fill_fp8_linear(module, original, block_size)
        del original
    return model


def _fill_fp8_linear(layer: nn.Module, dense: nn.Linear, block_size) -> None:
    weight, scale = quantize_fp8(dense.weight.detach(), block_size or tuple(dense.weight.shape))
    layer.weight.copy_(weight)
    layer.weight_scale_inv.copy_(scale.reshape(layer.weight_scale_inv.shape))
    if dense.bias is not None:
        layer.bias.copy_(dense.bias)


def _fill_fp8_experts(experts: nn.Module, dense: nn.Module, block_size) -> None:
    """Each expert's projections quantized like a linear's. transformers allocates at least two rows of scales
    for a stacked gate/up; where the weight needs one, both hold it."""
    names = ("gate_up_proj", "down_proj") if experts.has_gate else ("up_proj", "down_proj")
    for name in names:
        weights, scales = getattr(experts, name), getattr(experts, f"{name}_scale_inv")
        for e, w in enumerate(getattr(dense, name).detach()):
            fp8, scale = quantize_fp8(w, block_size or tuple(w.shape))
            weights[e].copy_(fp8)
            scales[e].copy_(scale.expand(scales.shape[1], -1) if scale.shape[0] == 1 else scale)
