"""Gated activations inside kernels: ``act(gate) * up`` on fp32 tiles, rounded where torch rounds.

Shared by the kernels that end in a gated MLP's activation: the elementwise one (:mod:`.gelu_mul`) and the fused
MoE's gate/up kernels (:mod:`.fused_moe`, :mod:`.fp8_moe`).
"""

from ._dispatch import tl, triton

# the tanh-GELU's constants: sqrt(2/pi), 0.044715
GELU_TANH_CONSTANTS = dict(K_BETA=0.7978845608028654, K_KAPPA=0.044715)
ACTIVATIONS = ("gelu_tanh", "silu", "swiglu_oai")


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 `x` rounded to DTYPE (to nearest even), as fp32. EMULATE_BF16: by integer ops, for Triton's CPU
    interpreter (3.9), whose fp32 -> bf16 cast truncates."""
    if EMULATE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def gated_activation(gate, up, limit, alpha, DTYPE: tl.constexpr, ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     EMULATE_BF16: tl.constexpr, K_BETA: tl.constexpr, K_KAPPA: tl.constexpr):
    """act(gate) * up of fp32 tiles holding DTYPE values, rounded to DTYPE after each op as torch does (fp32):
    ``gelu(gate, approximate="tanh") * up`` or ``silu(gate) * up``, with HAS_LIMIT (SiLU) Step 3.5's clamps
    ``silu(gate).clamp(max=limit) * up.clamp(-limit, limit)``; or gpt-oss's ``swiglu_oai``: ``g = gate.clamp(max=limit)``,
    ``(up.clamp(-limit, limit) + 1) * (g * sigmoid(g * alpha))``. tanh is written with exp (``1 - 2 / (exp(2z) + 1)``),
    within a few fp32 ulps of the libm tanh."""
    if ACTIVATION == "swiglu_oai":
        g = tl.minimum(gate, limit)
        sig = round_to(1.0 / (1.0 + tl.exp(-round_to(g * alpha, DTYPE, EMULATE_BF16))), DTYPE, EMULATE_BF16)
        glu = round_to(g * sig, DTYPE, EMULATE_BF16)
        up1 = round_to(tl.minimum(tl.maximum(up, -limit), limit) + 1.0, DTYPE, EMULATE_BF16)
        return round_to(up1 * glu, DTYPE, EMULATE_BF16)
    if ACTIVATION == "gelu_tanh":
        inner = K_BETA * (gate + K_KAPPA * (gate * gate * gate))
        # |2 * inner| > 80: tanh is +-1 in fp32 already; the clamp keeps exp finite
        tanh = 1.0 - 2.0 / (tl.exp(tl.minimum(tl.maximum(2.0 * inner, -80.0), 80.0)) + 1.0)
        act = round_to(0.5 * gate * (1.0 + tanh), DTYPE, EMULATE_BF16)
    else:
        act = round_to(gate / (1.0 + tl.exp(-gate)), DTYPE, EMULATE_BF16)
        if HAS_LIMIT:
            act = round_to(tl.minimum(act, limit), DTYPE, EMULATE_BF16)
            up = round_to(tl.minimum(tl.maximum(up, -limit), limit), DTYPE, EMULATE_BF16)
    return round_to(act * up, DTYPE, EMULATE_BF16)
