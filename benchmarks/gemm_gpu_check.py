"""Decode-sized GEMMs (``x [rows, K] @ W.T``, ``W [N, K]``): ``skinny_matmul`` tile configs vs cuBLAS (``F.linear``),
at the projection shapes of the Gemma 4 26B-A4B, E4B and E2B targets, on one CUDA GPU.

    python -m benchmarks.gemm_gpu_check [--shapes 26b-qkv 26b-o ...] [--rows 1 4 8] [--split 1 2 4]

Each case is a CUDA graph of calls over enough copies of the weight (>= 256 MB in all) that no call finds its
weight in L2, as a decode step's layers do not; the time per call is the graph's median replay time (of 50)
over the number of calls. GB/s counts the weight bytes once per call (an H100's copy bandwidth is ~3.0 TB/s).
``--split`` runs every config at each of these numbers of K parts (split-K: an fp32 partial per part and a launch
that sums them, both timed; a number past the config's K tiles is left out); without it each config runs at the
parts the launcher would choose. Prints a table per shape (the fastest case first), then one JSON line with every
case.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from hf_specdec.kernels.skinny_gemm import launch_plan, skinny_matmul, split_k_for

# (N, K): the stacked q/k/v (sliding layer: 16 q heads + 8 k + 8 v heads of 256), o, the dense MLP's stacked
# gate/up and its down, the router; E4B and E2B sliding-layer q/k/v and MLP shapes, and their LM heads
SHAPES = {
    "26b-qkv": (8192, 2816), "26b-o": (2816, 4096), "26b-gate-up": (4224, 2816), "26b-down": (2816, 2112),
    "26b-router": (128, 2816),
    "e4b-qkv": (3072, 2560), "e4b-o": (2560, 2048), "e4b-gate-up": (20480, 2560), "e4b-down": (2560, 10240),
    "e2b-qkv": (2560, 1536), "e2b-o": (1536, 2048), "e2b-gate-up": (12288, 1536), "e2b-down": (1536, 6144),
    # Gemma 4's LM head (the tied embedding, 262,144 rows) at E2B's and E4B's hidden sizes
    "e2b-lm-head": (262144, 1536), "e4b-lm-head": (262144, 2560),
    # the 31B's o and down, then one rank's shards of its sliding layers under tensor parallelism over 2 GPUs
    # (q/k/v and gate/up column-parallel, alone and stacked; o and down row-parallel)
    "31b-o": (5376, 8192), "31b-down": (5376, 21504),
    "31b-tp2-q": (4096, 5376), "31b-tp2-kv": (2048, 5376), "31b-tp2-qkv": (8192, 5376), "31b-tp2-o": (5376, 4096),
    "31b-tp2-gate": (10752, 5376), "31b-tp2-gate-up": (21504, 5376), "31b-tp2-down": (5376, 10752),
}
CONFIGS = [(16, 256, 2, 4), (16, 512, 4, 4), (32, 128, 4, 4), (32, 128, 4, 6), (32, 256, 4, 4), (32, 512, 4, 4),
           (32, 512, 8, 3), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 4), (64, 256, 8, 4)]
REPLAYS = 50
COPY_BYTES = 256 << 20


def graph_us(fn, xs, weights, replays: int = REPLAYS) -> float:
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
    for _ in range(replays):
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
    parser.add_argument("--split", nargs="+", type=int, default=None,
                        help="K parts to run every config at (default: the launcher's choice per config)")
    parser.add_argument("--configs", nargs="+", default=None, metavar="N,K,WARPS,STAGES",
                        help="tile configs to run (default: a list of 11)")
    parser.add_argument("--replays", type=int, default=REPLAYS)
    parser.add_argument("--copy-mb", type=int, default=COPY_BYTES >> 20,
                        help="MB of weight copies per case (past the L2 cache)")
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs] if args.configs else CONFIGS
    timed = lambda fn, x, weights: graph_us(fn, x, weights, args.replays)  # noqa: E731
    torch.manual_seed(0)
    rows_out = []
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(2, (args.copy_mb << 20) // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            expected = F.linear(x, weights[0])
            cases = [("cublas", timed(lambda x, w: F.linear(x, w), x, weights))]
            for config in configs:
                tiles = -(-k // config[1])
                for split in args.split or [split_k_for(n, k, config[0], config[1])]:
                    if split > tiles:
                        continue
                    got = skinny_matmul(x, weights[0], config, split)
                    assert (got.float() - expected.float()).abs().max() <= 2e-2 * expected.float().abs().max() + 1e-3
                    cases.append(((config, split),
                                  timed(lambda x, w, c=config, s=split: skinny_matmul(x, w, c, s), x, weights)))
            default = launch_plan(n, k, rows)[:2]
            print(f"{name} [{n}, {k}] ({n * k * 2 / 1e6:.1f} MB), rows {rows}, default (config, split) {default}:")
            for case, us in sorted(cases, key=lambda c: c[1]):
                gbs = n * k * 2 / us / 1e3
                print(f"  {str(case):28s} {us:8.2f} us  {gbs:7.0f} GB/s{'  <- default' if case == default else ''}")
                config, split = case if case != "cublas" else (case, 1)
                rows_out.append(dict(shape=name, n=n, k=k, rows=rows, config=str(config), split=split, us=us,
                                     gb_per_s=gbs, default=case == default))
    print(json.dumps(dict(bench="gemm_gpu_check", gpu=torch.cuda.get_device_name(), rows=rows_out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
