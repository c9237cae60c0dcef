"""The decode attention's schedules swept at real shapes, graph-timed (one CUDA GPU).

    PYTHONPATH=. python -m benchmarks.attention_sweep [--layers e2b_sliding 26b_full ...] [--batch 1 8]
        [--contexts 640] [--q-len 1] [--block-n 0 16 32] [--chunks 0 32 64 128] [--stages 0 2 3]

Each case is one `paged_attention` launch (split-KV chunks and their merge included) inside a CUDA graph of calls over
copies of the pages (none in L2), as `benchmarks.kernels_gpu_check --graph` times it; 0 in a list means the launcher's
own choice. Every config's output is checked against the default's (the largest difference is printed). Prints one
line per case, then the best config of each (layer, batch, context) against the default.
"""

from __future__ import annotations

import argparse
import importlib
import itertools

import torch

from benchmarks.gemm_gpu_check import COPY_BYTES, graph_us
from benchmarks.kernels_gpu_check import LAYERS, make_inputs

pa = importlib.import_module("hf_specdec.kernels.paged_attention")  # the package's name is the function


def _run(args, kwargs, out, block_n, chunk, stages):
    q, k_cache, v_cache, *index = args
    return pa._paged_attention_triton(q, k_cache, v_cache, *index, **kwargs, causal=True, out=out,
                                      block_n=block_n or None, kv_chunk_keys=chunk or None,
                                      num_stages=stages or None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", choices=list(LAYERS),
                        default=["e2b_sliding", "e2b_full", "26b_sliding", "26b_full", "sliding", "full"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--contexts", nargs="+", type=int, default=[640])
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--block-n", nargs="+", type=int, default=[0, 16, 64])
    parser.add_argument("--chunks", nargs="+", type=int, default=[0, 32, 128])
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2])
    opts = parser.parse_args(argv)
    torch.manual_seed(0)
    summary = []
    for layer, batch, context in itertools.product(opts.layers, opts.batch, opts.contexts):
        shape = LAYERS[layer]
        args = make_inputs(batch, context, opts.q_len, **shape)
        kwargs = dict(scale=shape["scale"], sliding_window=shape["sliding_window"])
        q, k_cache, v_cache, *index = args
        copies = max(1, -(-COPY_BYTES // 2 // (2 * k_cache.numel() * k_cache.element_size())))
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(copies)]
        expected = _run(args, kwargs, torch.empty_like(q), 0, 0, 0).float()
        rows = []
        for block_n, chunk, stages in itertools.product(opts.block_n, opts.chunks, opts.stages):
            if chunk and block_n and chunk % block_n:
                continue
            out = torch.empty_like(q)
            try:
                got = _run(args, kwargs, out, block_n, chunk, stages)
                diff = float((got.float() - expected).abs().max())
                us = graph_us(lambda x, kv: _run((x, *kv, *index), kwargs, out, block_n, chunk, stages),
                              q, caches, replays=20)
            except Exception as error:  # noqa: BLE001 - a config that does not fit shared memory: say so, go on
                print(f"{layer:12s} b{batch} ctx{context} n{block_n} c{chunk} s{stages}: "
                      f"{type(error).__name__}")
                continue
            rows.append((us, block_n, chunk, stages, diff))
            print(f"{layer:12s} b{batch} ctx{context} n{block_n:<3d} c{chunk:<4d} s{stages}: "
                  f"{us:7.2f} us  max diff {diff:.3g}", flush=True)
        default = next(r for r in rows if r[1:4] == (0, 0, 0))
        best = min(rows)
        summary.append(f"{layer:12s} b{batch} ctx{context}: default {default[0]:.2f} us, best {best[0]:.2f} us "
                       f"(n{best[1]} c{best[2]} s{best[3]}, {default[0] / best[0]:.3f}x)")
    print("\n".join(["", "best against the default:", *summary]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
