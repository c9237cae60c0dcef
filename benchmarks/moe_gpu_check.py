"""Fused MoE (``hf_specdec.kernels.fused_moe``) vs its torch reference at the real expert shapes, on one CUDA GPU.

    python -m benchmarks.moe_gpu_check [--shapes gemma4-26b-a4b step3p5] [--tokens 1 4 8 32 512] [--sweep | --profile]
                                       [--weights bf16 | fp8 | w8a8 | both | all]

Shapes (bf16, random weights of std 1/sqrt(fan_in)): Gemma 4 26B-A4B experts (128 experts, top-8, hidden 2816,
intermediate 704, gelu-tanh, gate/up as the two halves of one stacked ``gate_up_proj``) and Step 3.5's
(288 experts, top-8, hidden 4096, intermediate 1280, SwiGLU clamped at 7.0 (illustrative), separate weights),
routed by the models' routers (``softmax_topk_route`` / ``sigmoid_bias_topk_route``) on random logits. Tokens 1
(decode), 4 (verify, k=3), 8, 32 and 512 (prefill). ``--weights fp8``: the same weights quantized to e4m3 in 128 x 128
blocks (``hf_specdec.kernels.fp8_moe.fused_moe_fp8``, its reference the dequantizing ``fused_moe_fp8_reference``;
bytes counted at one per weight); ``w8a8``: the same e4m3 weights with the token and intermediate rows quantized per
row and group of 128 (``fused_moe_fp8(..., w8a8=True)``, as transformers' ``FP8Experts`` computes on GPUs with FP8
tensor cores; its reference quantizes and dequantizes the rows); ``both``: bf16, then fp8; ``all``: bf16, fp8, w8a8.

Per case: the max error relative to the output's scale, ``max|out - ref| / max|ref|`` (pass < 2e-2; W8A8: < 5e-2
with 95% of the outputs within 2e-2, ``W8A8_PASS_REL_ERROR``); whether the whole layer captures in a CUDA graph and
a replay on a new routing equals the eager call; the graph-replayed
time (median of 100 replays, each on a fresh routing so the selected experts are not already in L2), the eager
times of fused_moe and of the reference (triton.testing.do_bench), the graph time of the expert grouping alone,
and the bytes of the union of the selected experts (``distinct * 3 * I * H * 2``) over the graph time as GB/s
(an H100's copy bandwidth is ~3.0 TB/s).

``--sweep`` times (BLOCK_N, BLOCK_K, num_warps, num_stages) of each kernel (gate/up, then down with the best
gate/up) at tokens 1 and 4 (or the given ``--tokens``, e.g. ``--sweep --tokens 512``) by graph replay and prints the
best ``MoeConfig`` per shape; ``--profile`` prints the
CUDA time of each kernel. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from itertools import product

import torch

from benchmarks.shapes import STEP3P5
from hf_specdec.kernels import fused_moe as fm
from hf_specdec.kernels.fp8_gemm import quantize_fp8
from hf_specdec.kernels.fp8_moe import fused_moe_fp8, fused_moe_fp8_reference, w8a8_config

SHAPES = {
    "gemma4-26b-a4b": dict(experts=128, top_k=8, hidden=2816, inter=704, activation="gelu_tanh", limit=None,
                           stacked=True),
    "step3p5": dict(experts=STEP3P5["step3p5"]["experts"], top_k=STEP3P5["step3p5"]["top_k"],
                    hidden=STEP3P5["step3p5"]["hidden_size"], inter=STEP3P5["step3p5"]["expert_size"],
                    activation="silu", limit=7.0, stacked=False),
    # gpt-oss-20b's experts: gate and up interleaved in one stacked projection, biases, its clamped SwiGLU
    "gpt-oss-20b": dict(experts=32, top_k=4, hidden=2880, inter=2880, activation="swiglu_oai", limit=7.0, alpha=1.702,
                        stacked="interleaved"),
}
TOKENS = (1, 4, 8, 32, 512)
PASS_REL_ERROR = 2e-2
# W8A8: an intermediate value one ulp from the reference's can round to the neighbouring e4m3 code (1/8-1/16 of it),
# so single outputs move by ~2% of the outputs' scale (tests/kernels/test_fp8_moe.py, assert_w8a8_close): a W8A8
# case passes with every output within W8A8_PASS_REL_ERROR and W8A8_CLOSE_SHARE of them within PASS_REL_ERROR (of
# the largest output)
W8A8_PASS_REL_ERROR = 5e-2
W8A8_CLOSE_SHARE = 0.95
REPLAYS = 100


FP8_BLOCKS = (128, 128)


@dataclass
class Result:
    shape: str
    weights: str
    tokens: int
    rel_error: float
    graph_ok: bool
    graph_us: float
    eager_us: float
    reference_us: float
    group_us: float
    distinct_experts: float
    gb_per_s: float
    close_share: float  # outputs within PASS_REL_ERROR of the largest
    passed: bool


class Layer:
    """One shape's weights on the GPU (bf16, or e4m3 with block scales) and the routings its cases draw from."""

    def __init__(self, name: str, weights: str = "bf16"):
        self.name, self.shape, self.weights = name, SHAPES[name], weights
        e, h, i = self.shape["experts"], self.shape["hidden"], self.shape["inter"]
        gen = torch.Generator(device="cuda").manual_seed(0)
        bf16 = dict(dtype=torch.bfloat16, device="cuda", generator=gen)
        gate_up = torch.randn(e, 2 * i, h, **bf16).mul_(h ** -0.5)
        self.biases = None
        if self.shape["stacked"] == "interleaved":  # gpt-oss's gate_up_proj: even and odd rows, nothing copied
            self.w_gate, self.w_up = gate_up[:, 0::2], gate_up[:, 1::2]
            stacked_bias, down_bias = torch.randn(e, 2 * i, **bf16), torch.randn(e, h, **bf16)
            self.biases = (stacked_bias[:, 0::2], stacked_bias[:, 1::2], down_bias)
        elif self.shape["stacked"]:  # Gemma 4's gate_up_proj: two strided views, nothing copied
            self.w_gate, self.w_up = gate_up[:, :i], gate_up[:, i:]
        else:
            self.w_gate, self.w_up = gate_up[:, :i].contiguous(), gate_up[:, i:].contiguous()
            del gate_up
        self.w_down = torch.randn(e, h, i, **bf16).mul_(i ** -0.5)
        if weights in ("fp8", "w8a8"):  # the stacked gate/up and the down projection, expert by expert
            if self.biases is not None:
                raise SystemExit(f"{name}: the FP8 expert kernels take no biases; run it with --weights bf16")
            if not self.shape["stacked"]:
                gate_up = torch.cat([self.w_gate, self.w_up], dim=1)
            self.fp8 = [_quantized(gate_up), _quantized(self.w_down)]
            del gate_up
            self.w_gate = self.w_up = self.w_down = None
        self.bias = torch.randn(e, device="cuda", generator=gen) * 0.1
        self.scale = torch.rand(e, device="cuda", generator=gen) + 0.5
        self.gen = gen

    def routing(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.randn(tokens, self.shape["experts"], device="cuda", generator=self.gen)
        if self.shape["activation"] in ("gelu_tanh", "swiglu_oai"):
            return fm.softmax_topk_route(logits, self.shape["top_k"], self.scale)
        return fm.sigmoid_bias_topk_route(logits, self.bias, self.shape["top_k"], True, 1.0)

    def inputs(self, tokens: int):
        """The layer's arguments for ``tokens`` tokens, the routing's index and weights last."""
        x = torch.randn(tokens, self.shape["hidden"], device="cuda", generator=self.gen).bfloat16()
        weights, index = self.routing(tokens)
        if self.weights in ("fp8", "w8a8"):
            return x, *self.fp8[0], *self.fp8[1], index, weights
        return x, self.w_gate, self.w_up, self.w_down, index, weights

    def kwargs(self, config=None) -> dict:
        extra = dict(block_size=FP8_BLOCKS, w8a8=self.weights == "w8a8") if self.weights != "bf16" else {}
        if self.biases is not None:
            extra.update(alpha=self.shape["alpha"], biases=self.biases)
        return dict(activation=self.shape["activation"], limit=self.shape["limit"], config=config, **extra)

    def call(self, args, config=None) -> torch.Tensor:
        return (fm.fused_moe if self.weights == "bf16" else fused_moe_fp8)(*args, **self.kwargs(config))

    def reference(self, args) -> torch.Tensor:
        kwargs = self.kwargs()
        del kwargs["config"]
        return (fm.fused_moe_reference if self.weights == "bf16" else fused_moe_fp8_reference)(*args, **kwargs)

    def default_config(self, tokens: int) -> fm.MoeConfig:
        return w8a8_config() if self.weights == "w8a8" else fm.config_for(tokens, fp8=self.weights == "fp8")

    def expert_bytes(self, distinct: float) -> float:
        return distinct * 3 * self.shape["inter"] * self.shape["hidden"] * (2 if self.weights == "bf16" else 1)


def _quantized(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [E, N, K], scales [E, ceil(N/128), ceil(K/128)]) of bf16 ``weights``."""
    pairs = [quantize_fp8(w, FP8_BLOCKS) for w in weights]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def graph_time(layer: Layer, args, fn, replays: int = REPLAYS) -> tuple[list[float], list[int]]:
    """Capture ``fn()`` over the static ``args`` and replay it on fresh routings: (microseconds per replay,
    distinct experts per replay)."""
    index, weights = args[-2], args[-1]
    routings = [layer.routing(index.shape[0]) for _ in range(replays)]
    fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in routings]
    for (w, i), (start, end) in zip(routings, events):
        index.copy_(i)
        weights.copy_(w)
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in events], [int(i.unique().numel()) for _, i in routings]


def check_graph(layer: Layer, args) -> bool:
    """The layer captures (no host sync inside) and a replay on a new routing equals the eager call."""
    index, weights = args[-2], args[-1]
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer.call(args)
    except RuntimeError as error:
        print(f"capture failed: {error}")
        return False
    w, i = layer.routing(index.shape[0])
    index.copy_(i)
    weights.copy_(w)
    graph.replay()
    return torch.equal(out, layer.call(args))


def check_case(layer: Layer, tokens: int) -> Result:
    import triton.testing

    args = layer.inputs(tokens)
    out = layer.call(args)
    ref = layer.reference(args)
    scale = ref.float().abs().max()
    rel_error = float((out.float() - ref.float()).abs().max() / scale)
    close_share = float(((out.float() - ref.float()).abs() <= PASS_REL_ERROR * scale).float().mean())
    graph_ok = check_graph(layer, args)
    times, distinct = graph_time(layer, args, lambda: layer.call(args))
    group_times, _ = graph_time(layer, args, lambda: fm.group_pairs(args[-2], layer.shape["experts"],
                                                                    fm.config_for(tokens).block_m))
    eager_us = triton.testing.do_bench(lambda: layer.call(args)) * 1e3
    reference_us = triton.testing.do_bench(lambda: layer.reference(args)) * 1e3
    gb_per_s = statistics.median(layer.expert_bytes(d) / (t * 1e-6) / 1e9 for t, d in zip(times, distinct))
    return Result(layer.name, layer.weights, tokens, rel_error, graph_ok, statistics.median(times), eager_us,
                  reference_us, statistics.median(group_times), statistics.mean(distinct), gb_per_s,
                  close_share, _passes(layer, rel_error, close_share) and graph_ok)


def _passes(layer: Layer, rel_error: float, close_share: float) -> bool:
    if layer.weights == "w8a8":
        return rel_error < W8A8_PASS_REL_ERROR and close_share >= W8A8_CLOSE_SHARE
    return rel_error < PASS_REL_ERROR


# ---------------------------------------------------------------- --sweep

# (BLOCK_N, BLOCK_K, num_warps, num_stages) grids: decode / verify (16-row blocks), prefill (taller blocks)
SWEEP_GRID = {16: ((16, 32, 64), (64, 128, 256), (2, 4), (3, 4, 5)),
              64: ((32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4))}
W8A8_SWEEP_GRID = ((32, 64, 128), (128,), (2, 4), (3, 4, 6, 8))  # the K step is the activations' group


def sweep(layer: Layer, tokens_list=(1, 4)) -> dict:
    """Graph-timed medians (summed over ``tokens_list``) of each gate/up config with the default down config, then
    of each down config with the best gate/up: the best MoeConfig (block_m: the default for tokens_list[0])."""
    cases = [layer.inputs(t) for t in tokens_list]
    default = layer.default_config(tokens_list[0])

    def total_us(config: fm.MoeConfig) -> float:
        try:
            us = sum(statistics.median(graph_time(layer, args, lambda: layer.call(args, config), replays=30)[0])
                     for args in cases)
        except Exception as error:  # e.g. out of shared memory for the deepest pipelines
            print(f"  {config}: {type(error).__name__}", flush=True)
            return float("inf")
        print(f"  {config}: {us:.1f} us", flush=True)
        return us

    grid = list(product(*(W8A8_SWEEP_GRID if layer.weights == "w8a8" else SWEEP_GRID[16 if default.block_m <= 32
                                                                                     else 64])))
    gate_up = {c: total_us(fm.MoeConfig(default.block_m, c, default.down)) for c in grid}
    best_gate_up = min(gate_up, key=gate_up.get)
    down = {c: total_us(fm.MoeConfig(default.block_m, best_gate_up, c)) for c in grid}
    best_down = min(down, key=down.get)
    baseline = total_us(default)
    for name, table in (("gate_up", gate_up), ("down", down)):
        top = sorted(table.items(), key=lambda kv: kv[1])[:5]
        print(f"{layer.name} {layer.weights} {name} best 5 (us, tokens {tokens_list} summed): "
              + ", ".join(f"{c}={us:.1f}" for c, us in top))
    best = fm.MoeConfig(default.block_m, best_gate_up, best_down)
    print(f"{layer.name} {layer.weights}: best {best} {down[best_down]:.1f} us vs default {default} {baseline:.1f} us")
    return dict(shape=layer.name, weights=layer.weights, best=asdict(best), best_us=down[best_down],
                default_us=baseline)


def profile(layer: Layer, tokens: int) -> None:
    """CUDA time per kernel of eager fused_moe calls (the same kernels a graph replays)."""
    args = layer.inputs(tokens)
    layer.call(args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            layer.call(args)
        torch.cuda.synchronize()
    print(f"{layer.name} {layer.weights}, {tokens} tokens, 20 calls:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["gemma4-26b-a4b", "step3p5"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--sweep", action="store_true",
                        help="tune the launch configs at tokens 1 and 4 (or the --tokens given) instead")
    parser.add_argument("--profile", action="store_true", help="CUDA time per kernel at each --tokens instead")
    parser.add_argument("--weights", choices=("bf16", "fp8", "w8a8", "both", "all"), default="bf16",
                        help="the experts' weights: bf16, e4m3 in 128 x 128 blocks (fp8: weight-only; w8a8: the rows "
                        "quantized as transformers' FP8Experts does), bf16 then fp8 (both), or all three")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False
    results, sweeps = [], []
    kinds = {"both": ("bf16", "fp8"), "all": ("bf16", "fp8", "w8a8")}.get(args.weights, (args.weights,))
    for name, weights in product(args.shapes, kinds):
        layer = Layer(name, weights)
        if args.sweep:
            sweeps.append(sweep(layer, tuple(args.tokens) if args.tokens != list(TOKENS) else (1, 4)))
        elif args.profile:
            for t in args.tokens:
                profile(layer, t)
        else:
            results += [check_case(layer, t) for t in args.tokens]
        del layer
        torch.cuda.empty_cache()
    if results:
        print(f"{'shape':15} {'weights':7} {'T':>4} {'rel_err':>8} {'graph':>5} {'graph_us':>8} {'eager_us':>8} "
              f"{'ref_us':>8} {'group_us':>8} {'experts':>7} {'GB/s':>6}  ok")
        for r in results:
            print(f"{r.shape:15} {r.weights:7} {r.tokens:4d} {r.rel_error:8.1e} {'yes' if r.graph_ok else 'NO':>5} "
                  f"{r.graph_us:8.1f} {r.eager_us:8.1f} {r.reference_us:8.0f} {r.group_us:8.1f} "
                  f"{r.distinct_experts:7.1f} {r.gb_per_s:6.0f}  {'yes' if r.passed else 'NO'}")
    all_pass = all(r.passed for r in results)
    print(json.dumps({"benchmark": "moe_gpu_check", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "all_pass": all_pass, "results": [asdict(r) for r in results],
                      "sweeps": sweeps}))
    return 0 if all_pass else 1


if __name__ == "__main__":
    sys.exit(main())
