"""Decode-sized GEMMs (``x [rows, K] @ W.T``, ``W [N, K]``): ``skinny_matmul`` tile configs vs cuBLAS (``F.linear``),
at the projection shapes of the Gemma 4 26B-A4B, E4B and E2B targets, on one CUDA GPU.

    python -m benchmarks.gemm_gpu_check [--shapes 26b-qkv 26b-o ...] [--rows 1 4 8]

Each case is a CUDA graph of calls over enough copies of the weight (>= 256 MB in all) that no call finds its
weight in L2, as a decode step's layers do not; the time per call is the graph's median replay time (of 50)
over the number of calls. GB/s counts the weight bytes once per call (an H100's copy bandwidth is ~3.0 TB/s).
Prints a table per shape (the fastest config first), then one JSON line with every case.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from hf_specdec.kernels.skinny_gemm import config_for, skinny_matmul

# (N, K): the stacked q/k/v (sliding layer: 16 q heads + 8 k + 8 v heads of 256), o, the dense MLP's stacked
# gate/up and its down, the router; E4B and E2B sliding-layer q/k/v and MLP shapes
SHAPES = {
    "26b-qkv": (8192, 2816), "26b-o": (2816, 4096), "26b-gate-up": (4224, 2816), "26b-down": (2816, 2112),
    "26b-router": (128, 2816),
    "e4b-qkv": (3072, 2560), "e4b-o": (2560, 2048), "e4b-gate-up": (20480, 2560), "e4b-down": (2560, 10240),
    "e2b-qkv": (2560, 1536), "e2b-o": (1536, 2048), "e2b-gate-up": (12288, 1536), "e2b-down": (1536, 6144),
}
CONFIGS = [(16, 256, 2, 4), (16, 512, 4, 4), (32, 128, 4, 4), (32, 256, 4, 4), (32, 512, 4, 4), (32, 512, 8, 3),
           (64, 128, 4, 4), (64, 256, 4, 4), (64, 256, 8, 4)]
REPLAYS = 50


def graph_us(fn, xs, weights) -> float:
    """Median time of one call in a graph of calls over every weight copy."""
    for _ in range(2):
        for w in weights:
            fn(xs, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(xs, w)
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8])
    args = parser.parse_args()
    torch.manual_seed(0)
    rows_out = []
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(2, (256 << 20) // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            expected = F.linear(x, weights[0])
            cases = [("cublas", graph_us(lambda x, w: F.linear(x, w), x, weights))]
            for config in CONFIGS:
                got = skinny_matmul(x, weights[0], config)
                assert (got.float() - expected.float()).abs().max() <= 2e-2 * expected.float().abs().max() + 1e-3
                cases.append((config, graph_us(lambda x, w, c=config: skinny_matmul(x, w, c), x, weights)))
            default = config_for(n, k)
            print(f"{name} [{n}, {k}] ({n * k * 2 / 1e6:.1f} MB), rows {rows}, default config {default}:")
            for config, us in sorted(cases, key=lambda c: c[1]):
                gbs = n * k * 2 / us / 1e3
                print(f"  {str(config):22s} {us:8.2f} us  {gbs:7.0f} GB/s")
                rows_out.append(dict(shape=name, n=n, k=k, rows=rows, config=str(config), us=us, gb_per_s=gbs,
                                     default=config == default))
    print(json.dumps(dict(bench="gemm_gpu_check", gpu=torch.cuda.get_device_name(), rows=rows_out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
