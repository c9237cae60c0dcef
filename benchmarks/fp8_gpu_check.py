"""The FP8 weight-only skinny GEMM (``hf_specdec.kernels.fp8_gemm``) against its reference and beside the bf16
skinny GEMM at the Gemma-4-31B decode shapes, on one CUDA GPU.

    python -m benchmarks.fp8_gpu_check [--rows 1 4 16] [--sweep] [--w8a8] [--shapes 31b 26b]

Per (shape, scale format, rows): the kernel's error against the dequantize-then-matmul reference (pass:
bf16 rounding), its graph-replayed time (``triton.testing.do_bench_cudagraph``) and TB/s counting the fp8 weight
and scale bytes once, beside the bf16 kernel on the same weights (``skinny_matmul``) and the speedup. Prints a
table, then one JSON line. ``--sweep`` times (BLOCK_N, BLOCK_K, num_warps, num_stages) configs of the kernel at one
row instead and prints the best few per (shape, format). ``--w8a8`` times the W8A8 kernels (``kernels.fp8_w8a8``:
activations quantized per row and group by one launch, e4m3 x e4m3 dots) beside them, their
error against its own reference, and its per-row variant (compressed-tensors' activations); with ``--sweep``, its
configs.
"""

from __future__ import annotations

import argparse
import json

import torch

# (N, K): the 31B MLP's stacked gate/up and its down, the attention's stacked q/k/v (sliding layer)
SHAPES = {"31b": [(43008, 5376), (5376, 21504), (16384, 5376)],
          # the 26B-A4B's q/k/v (sliding), o, dense gate/up and down
          "26b": [(8192, 2816), (2816, 4096), (4224, 2816), (2816, 2112)]}
FORMATS = {"block128": (128, 128), "channel": None}


def main() -> int:
    import triton

    from hf_specdec.kernels.fp8_gemm import fp8_linear_reference, fp8_matmul, quantize_fp8
    from hf_specdec.kernels.skinny_gemm import skinny_matmul

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--sweep", action="store_true", help="time tile configs at one row instead")
    parser.add_argument("--w8a8", action="store_true", help="time the W8A8 kernel too")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["31b"])
    args = parser.parse_args()
    torch.manual_seed(0)
    shapes = [shape for name in args.shapes for shape in SHAPES[name]]
    if args.w8a8 and torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("fp8_gpu_check: --w8a8 needs e4m3 dots (sm_89+: Ada, Hopper and later); this GPU is "
                         f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    if args.sweep:
        if args.w8a8:
            from itertools import product

            from hf_specdec.kernels.fp8_w8a8 import w8a8_matmul

            grid = list(product((64, 128), (128,), (4, 8), (3, 4, 6)))  # the K step is one group of 128
            return sweep(triton, lambda x, w8, scale, block, c: w8a8_matmul(x, w8, scale, block, config=c),
                         quantize_fp8, shapes, {"block128": FORMATS["block128"]}, grid)
        return sweep(triton, fp8_matmul, quantize_fp8, shapes)
    if args.w8a8:
        return w8a8_rows(triton, quantize_fp8, fp8_matmul, skinny_matmul, shapes, args.rows)
    rows_out, ok = [], True
    print(f"{'N':>6} {'K':>6} {'format':9} {'rows':>4} {'fp8 us':>8} {'fp8 TB/s':>8} {'bf16 us':>8} "
          f"{'bf16 TB/s':>9} {'speedup':>7} {'rel err':>8}")
    for n, k, fmt, block, w, w8, scale, rows, x in cases(quantize_fp8, shapes, args.rows):
        got, ref = fp8_matmul(x, w8, scale, block).float(), fp8_linear_reference(x, w8, scale, block).float()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        ok &= err < 2e-2
        fp8_ms = triton.testing.do_bench_cudagraph(lambda: fp8_matmul(x, w8, scale, block))
        bf16_ms = triton.testing.do_bench_cudagraph(lambda: skinny_matmul(x, w))
        fp8_bytes = w8.numel() + scale.numel() * scale.element_size()
        r = dict(n=n, k=k, format=fmt, rows=rows, fp8_us=fp8_ms * 1e3, fp8_tb_s=fp8_bytes / fp8_ms / 1e9,
                 bf16_us=bf16_ms * 1e3, bf16_tb_s=w.numel() * 2 / bf16_ms / 1e9, speedup=bf16_ms / fp8_ms,
                 rel_error=err)
        rows_out.append(r)
        print(f"{n:6d} {k:6d} {fmt:9} {rows:4d} {r['fp8_us']:8.1f} {r['fp8_tb_s']:8.2f} {r['bf16_us']:8.1f} "
              f"{r['bf16_tb_s']:9.2f} {r['speedup']:7.2f} {err:8.1e}")
    print(json.dumps(dict(bench="fp8_gpu_check", gpu=torch.cuda.get_device_name(), ok=ok, rows=rows_out)))
    return 0 if ok else 1


def cases(quantize_fp8, shapes, row_counts):
    """(n, k, format, block_size, bf16 weight, fp8 weight, scale, rows, x) for every shape, format and row count."""
    for n, k in shapes:
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).bfloat16()
        for fmt, block in FORMATS.items():
            w8, scale = quantize_fp8(w, block)
            for rows in row_counts:
                yield n, k, fmt, block, w, w8, scale, rows, torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)


def w8a8_rows(triton, quantize_fp8, fp8_matmul, skinny_matmul, shapes, row_counts) -> int:
    from hf_specdec.kernels import fp8_w8a8
    from hf_specdec.kernels.fp8_w8a8 import w8a8_linear_reference, w8a8_matmul

    def fast_acc(fn):  # Triton's default accumulation of the FP8 dots
        def run():
            kept, fp8_w8a8.MAX_IMPRECISE_ACC = fp8_w8a8.MAX_IMPRECISE_ACC, None
            try:
                fn()
            finally:
                fp8_w8a8.MAX_IMPRECISE_ACC = kept
        return run

    rows_out, ok = [], True
    print(f"{'N':>6} {'K':>6} {'format':9} {'rows':>4} {'w-only us':>9} {'w8a8 us':>8} {'TB/s':>6} {'per-row':>7} "
          f"{'fast acc':>8} {'bf16 us':>8} {'vs w-only':>9} {'vs bf16':>7} {'rel err':>8}")
    for n, k, fmt, block, w, w8, scale, rows, x in cases(quantize_fp8, shapes, row_counts):
        err = 0.0
        for per_row in (False, True):
            got = w8a8_matmul(x, w8, scale, block, per_row=per_row).float()
            ref = w8a8_linear_reference(x, w8, scale, block, per_row=per_row).float()
            err = max(err, ((got - ref).abs().max() / ref.abs().max()).item())
        ok &= err < 2e-2  # the FP8 tensor cores' own accumulation: up to 1.4e-2 of the largest output on an H200
        times = {name: triton.testing.do_bench_cudagraph(fn) * 1e3 for name, fn in (
            ("w8a8", lambda: w8a8_matmul(x, w8, scale, block)),
            ("per_row", lambda: w8a8_matmul(x, w8, scale, block, per_row=True)),
            ("fast_acc", fast_acc(lambda: w8a8_matmul(x, w8, scale, block))),
            ("weight_only", lambda: fp8_matmul(x, w8, scale, block)),
            ("bf16", lambda: skinny_matmul(x, w)))}
        fp8_bytes = w8.numel() + scale.numel() * scale.element_size()
        r = dict(n=n, k=k, format=fmt, rows=rows, **{f"{key}_us": v for key, v in times.items()},
                 w8a8_tb_s=fp8_bytes / times["w8a8"] / 1e6, rel_error=err)
        rows_out.append(r)
        print(f"{n:6d} {k:6d} {fmt:9} {rows:4d} {times['weight_only']:9.1f} {times['w8a8']:8.1f} "
              f"{r['w8a8_tb_s']:6.2f} {times['per_row']:7.1f} {times['fast_acc']:8.1f} {times['bf16']:8.1f} "
              f"{times['weight_only'] / times['w8a8']:9.2f} {times['bf16'] / times['w8a8']:7.2f} {err:8.1e}")
    print(json.dumps(dict(bench="fp8_gpu_check_w8a8", gpu=torch.cuda.get_device_name(), ok=ok, rows=rows_out)))
    return 0 if ok else 1


def sweep(triton, fp8_matmul, quantize_fp8, shapes, formats=FORMATS, configs=None) -> int:
    from itertools import product

    results = []
    for n, k in shapes:
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).bfloat16()
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for fmt, block in formats.items():
            w8, scale = quantize_fp8(w, block)
            timed = []
            # block scales: a K tile of BLOCK_K is BLOCK_K / 128 dots, one per block of scales
            grid = configs or (product((16, 32, 64), (128, 256, 512), (4,), (3, 4, 6)) if block else
                               product((16, 32, 64), (256, 512, 1024), (4,), (4, 6)))
            for config in grid:
                try:
                    ms = triton.testing.do_bench_cudagraph(lambda c=config: fp8_matmul(x, w8, scale, block, c))
                except Exception as error:  # a config the device cannot run (shared memory)
                    print(f"  {config}: {type(error).__name__}")
                    continue
                timed.append((ms * 1e3, config))
            timed.sort()
            best = [dict(us=us, config=config, tb_s=(w8.numel() + scale.numel() * scale.element_size()) / us / 1e6)
                    for us, config in timed[:5]]
            print(f"[{n}, {k}] {fmt}: " + "; ".join(f"{b['config']} {b['us']:.1f} us {b['tb_s']:.2f} TB/s"
                                                      for b in best))
            results.append(dict(n=n, k=k, format=fmt, best=best))
    print(json.dumps(dict(bench="fp8_gpu_check_sweep", gpu=torch.cuda.get_device_name(), rows=results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
