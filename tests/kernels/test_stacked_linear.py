"""Stacked projections: one storage for q/k/v (gate/up) weights, the same parameters, values and outputs."""

import pytest
import torch
import torch.nn as nn

from hf_specdec.kernels.stacked_linear import stack_weights, stacked_fp8, stacked_projections, stacked_weight


def _linears(*outs, width=12, bias=False, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(width, n, bias=bias) for n in outs]


def test_stacking_keeps_parameters_and_values_and_one_gemm_gives_each_projection():
    q, k, v = _linears(8, 4, 4)
    params = [m.weight for m in (q, k, v)]
    values = [p.detach().clone() for p in params]
    x = torch.randn(2, 3, 12)
    before = [m(x) for m in (q, k, v)]
    assert stacked_weight(q, k, v) is None
    assert stack_weights(q, k, v)
    assert [m.weight for m in (q, k, v)] == params  # the same Parameter objects
    for p, value in zip(params, values):
        assert torch.equal(p, value)
    stacked = stacked_weight(q, k, v)
    assert stacked.shape == (16, 12) and stacked.data_ptr() == q.weight.data_ptr()
    for got, want in zip(stacked_projections(x, q, k, v), before):
        torch.testing.assert_close(got, want)
    # order matters: the rows of k come after those of q
    assert stacked_weight(k, q, v) is None
    assert stacked_weight(q, k) is not None


def test_updates_in_place_reach_the_stacked_view():
    gate, up = _linears(6, 6)
    assert stack_weights(gate, up)
    with torch.no_grad():
        up.weight.add_(1.0)
    stacked = stacked_weight(gate, up)
    assert torch.equal(stacked[6:], up.weight)


def test_separated_weights_fall_back_to_one_call_per_projection():
    gate, up = _linears(6, 6)
    assert stack_weights(gate, up)
    up.weight.data = up.weight.detach().clone()  # what .to(), or load_state_dict(assign=True), does
    assert stacked_weight(gate, up) is None
    x = torch.randn(5, 12)
    g, u = stacked_projections(x, gate, up)
    torch.testing.assert_close(g, gate(x))
    torch.testing.assert_close(u, up(x))


@pytest.mark.parametrize("case", ["bias", "hook", "dtype", "width"])
def test_projections_that_cannot_share_a_gemm_are_left_alone(case):
    a, b = _linears(4, 4, bias=case == "bias")
    if case == "hook":
        b.register_forward_hook(lambda module, args, out: out * 2)
    elif case == "dtype":
        b.to(torch.float64)
    elif case == "width":
        b = nn.Linear(10, 4, bias=False)
    ptrs = (a.weight.data_ptr(), b.weight.data_ptr())
    assert not stack_weights(a, b)
    assert (a.weight.data_ptr(), b.weight.data_ptr()) == ptrs
    assert stacked_weight(a, b) is None
    if case in ("bias", "hook"):
        x = torch.randn(3, 12)
        assert torch.equal(stacked_projections(x, a, b)[1], b(x))


def test_a_hook_added_after_stacking_still_runs():
    a, b = _linears(4, 4)
    assert stack_weights(a, b)
    b.register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(3, 12)
    assert stacked_weight(a, b) is None
    torch.testing.assert_close(stacked_projections(x, a, b)[1], b(x))


def test_projections_a_device_map_hooks_share_a_gemm_where_the_hooks_only_move_inputs(monkeypatch):
    """accelerate's device map hooks every projection of a layer placed on a GPU with a hook that only moves its inputs
    there (the layer's own hook already did): those share a GEMM; a hook that does more (offload: it loads the
    weights around the forward) keeps each projection's own forward."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from hf_specdec.kernels import _dispatch

    q, k, v = _linears(8, 4, 4)
    for linear in (q, k, v):
        add_hook_to_module(linear, ModelHook())
    x = torch.randn(3, 12)
    before = [m(x) for m in (q, k, v)]
    assert not stack_weights(q, k, v) and stacked_weight(q, k, v) is None  # not known to move inputs only
    monkeypatch.setattr(_dispatch, "moves_activations_only", lambda module: module is not v)
    assert not stack_weights(q, k, v)
    monkeypatch.setattr(_dispatch, "moves_activations_only", lambda module: True)  # as on a GPU of the map
    assert stack_weights(q, k, v) and stacked_weight(q, k, v) is not None
    handle = k.register_forward_pre_hook(lambda module, args: None)
    assert stacked_weight(q, k, v) is None  # anyone else's hook: each projection runs its own forward again
    handle.remove()
    got = stacked_projections(x, q, k, v)
    assert got[0].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr()  # one product
    for g, want in zip(got, before):
        torch.testing.assert_close(g, want)


def test_a_model_with_stacked_projections_saves_and_loads_its_own_weights(tmp_path):
    """save_pretrained writes each projection under its own key; loading gives the same weights back."""
    import transformers

    from hf_specdec.generation.fusion import stacked_groups
    from tests.tiny_models import gemma4_31b_style

    model = gemma4_31b_style()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    stacked = 0
    for module in model.modules():
        for names in stacked_groups(module):
            linears = [getattr(module, n) for n in names if getattr(module, n, None) is not None]
            stacked += stack_weights(*linears)
    assert stacked >= 2 * len(model.model.layers)
    assert model.state_dict().keys() == expected.keys()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_adjacent_weights_with_a_bias_do_not_share_a_gemm():
    """Weights that lie back to back (stacked, then a bias given to one) run one by one: the stacked GEMM has no
    bias."""
    gate, up = _linears(6, 6)
    assert stack_weights(gate, up)
    up.bias = nn.Parameter(torch.ones(6))
    assert stacked_weight(gate, up) is None
    x = torch.randn(5, 12)
    torch.testing.assert_close(stacked_projections(x, gate, up)[1], up(x))


def _fp8_linears(*outs, width=64, block=(32, 32), seed=0):
    """transformers' FP8Linear layers holding the block-FP8 copies of random dense weights."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from hf_specdec.kernels.fp8_gemm import quantize_fp8

    torch.manual_seed(seed)
    layers = []
    for n in outs:
        layer = FP8Linear(width, n, block_size=block)
        weight, scale = quantize_fp8(torch.randn(n, width) * 0.1, block)
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.weight_scale_inv.copy_(scale)
        layers.append(layer)
    return layers


def test_fp8_projections_stack_weights_and_scales():
    """q/k/v in FP8: weights and block scales each move into one storage (same parameters and values), and one
    FP8 GEMM over the stacked views gives each projection's own FP8 GEMM, bit for bit (columns are computed
    alike whatever the rows around them), within a rounding of the weight-only contract."""
    from hf_specdec.kernels.fp8_gemm import fp8_linear, fp8_linear_reference

    q, k, v = _fp8_linears(64, 32, 32)
    params = [(m.weight, m.weight_scale_inv) for m in (q, k, v)]
    values = [(w.detach().clone(), s.detach().clone()) for w, s in params]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want = [fp8_linear(x, m.weight, m.weight_scale_inv, m.block_size) for m in (q, k, v)]
    for got, m in zip(want, (q, k, v)):
        torch.testing.assert_close(got, fp8_linear_reference(x, m.weight, m.weight_scale_inv, m.block_size),
                                   rtol=2 ** -7, atol=1e-5)
    assert stacked_fp8(q, k, v) is None
    assert stack_weights(q, k, v)
    assert [(m.weight, m.weight_scale_inv) for m in (q, k, v)] == params
    for (w, s), (w0, s0) in zip(params, values):
        assert torch.equal(w.view(torch.uint8), w0.view(torch.uint8)) and torch.equal(s, s0)
    weight, scale, block = stacked_fp8(q, k, v)
    assert weight.shape == (128, 64) and scale.shape == (4, 2) and block == (32, 32)
    assert weight.data_ptr() == q.weight.data_ptr() and scale.data_ptr() == q.weight_scale_inv.data_ptr()
    for got, expected in zip(stacked_projections(x, q, k, v), want):
        assert torch.equal(got, expected)
    assert stacked_fp8(k, q, v) is None  # order matters


def test_stacked_fp8_projections_quantize_activations_as_each_layer_does(monkeypatch):
    """Where the layers quantize their activations (a GPU with FP8 tensor cores), the stacked projections take the
    layers' W8A8 arithmetic (here on CPU tensors, by the reference: each layer's own W8A8 forward, bit for bit), and
    a block as wide as K quantizes per row as the layers do."""
    from hf_specdec.kernels import fp8_w8a8

    monkeypatch.setattr(fp8_w8a8, "activations_quantized", lambda x: True)
    q, k, v = _fp8_linears(64, 32, 32, width=96)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    want = [fp8_w8a8.fp8_linear_forward(m, x) for m in (q, k, v)]
    assert not torch.equal(want[0], fp8_w8a8.fp8_linear(x, q.weight, q.weight_scale_inv, q.block_size))
    assert stack_weights(q, k, v)
    for got, expected in zip(stacked_projections(x, q, k, v), want):
        assert torch.equal(got, expected)
    gate, up = _fp8_linears(32, 32, width=256, block=(32, 256))  # one K block: per-row activation scales
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    x[:, 128:] *= 50  # per row and per group of 128 differ
    want = [fp8_w8a8.fp8_linear_forward(m, x) for m in (gate, up)]
    assert not torch.equal(want[0], fp8_w8a8.w8a8_linear(x, gate.weight, gate.weight_scale_inv, (32, 256)))
    assert stack_weights(gate, up)
    for got, expected in zip(stacked_projections(x, gate, up), want):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("case", ["partial block", "block size", "bias", "static activations"])
def test_fp8_projections_that_cannot_share_a_gemm_are_left_alone(case):
    a, = _fp8_linears(48 if case == "partial block" else 32)  # 48 rows: a scale block half used
    b, = _fp8_linears(32, block=(16, 16) if case == "block size" else (32, 32), seed=1)
    if case == "bias":
        b.bias = nn.Parameter(torch.zeros(32))
    if case == "static activations":  # its scale belongs to the layer
        b.activation_scheme = "static"
        b.activation_scale = nn.Parameter(torch.tensor(0.1))
    assert not stack_weights(a, b)
    assert stacked_fp8(a, b) is None
