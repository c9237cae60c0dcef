"""Triton paged attention vs its torch reference at the real attention shapes, on one CUDA GPU.

    PYTHONPATH=. python benchmarks/kernels_gpu_check.py [--layers sliding full e4b_sliding ...] [--batch 1 8]
        [--contexts 2048 8192] [--q-lens 1 8] [--no-prefill | --prefill 1:2048:2048 ...] [--graph]

Layers (default: all): Gemma-4-31B sliding (32 q / 16 kv heads, head_dim 256, window 1024) and full (32 q /
4 kv heads, head_dim 512); Gemma 4 E4B sliding (8 q / 2 kv, 256, window 512) and full (8 q / 2 kv, 512);
Step 3.5 full (64 q / 8 kv, 128) and sliding (96 q / 8 kv, 128, window 512); Gemma 4 E2B sliding (8 q / 1 kv, 256,
window 512) and full (8 q / 1 kv, 512); 26B-A4B sliding (16 q / 8 kv, 256, window 1024) and full (16 q / 2 kv, 512).
Decode (T=1) and verify (T=8); batch 1 and 8; context 2048 and 8192 (each settable); block_size 16;
bf16 with random pages (shuffled physical blocks, released window blocks set to -1); plus a left-padded prefill
(T=512 after 1536 cached keys, batch 2; ``--prefill`` sets others) per layer, whose GB/s is not its measure
(compute-bound). Per case: relative error ||out - ref|| / ||ref|| (pass < 1e-2), median time
(triton.testing.do_bench, or with ``--graph`` one call's share of a CUDA graph of calls over copies of the pages,
as a decode step runs it), and bandwidth counting the K/V bytes of the keys the queries can see. Prints a table,
then one JSON line.
"""

import json
import math
import sys
from dataclasses import asdict, dataclass
from itertools import product

import torch

from hf_specdec.kernels import paged_attention, paged_attention_reference, store_kv, store_kv_reference

# scale: Gemma 4 normalises q and k (scaling 1.0); Step 3.5 uses 1/sqrt(head_dim)
LAYERS = {
    "sliding": dict(num_heads=32, num_kv_heads=16, head_dim=256, sliding_window=1024, scale=1.0),
    "full": dict(num_heads=32, num_kv_heads=4, head_dim=512, sliding_window=None, scale=1.0),
    "e4b_sliding": dict(num_heads=8, num_kv_heads=2, head_dim=256, sliding_window=512, scale=1.0),
    "e4b_full": dict(num_heads=8, num_kv_heads=2, head_dim=512, sliding_window=None, scale=1.0),
    "step_full": dict(num_heads=64, num_kv_heads=8, head_dim=128, sliding_window=None, scale=128 ** -0.5),
    "step_sliding": dict(num_heads=96, num_kv_heads=8, head_dim=128, sliding_window=512, scale=128 ** -0.5),
    "e2b_sliding": dict(num_heads=8, num_kv_heads=1, head_dim=256, sliding_window=512, scale=1.0),
    "e2b_full": dict(num_heads=8, num_kv_heads=1, head_dim=512, sliding_window=None, scale=1.0),
    "26b_sliding": dict(num_heads=16, num_kv_heads=8, head_dim=256, sliding_window=1024, scale=1.0),
    "26b_full": dict(num_heads=16, num_kv_heads=2, head_dim=512, sliding_window=None, scale=1.0),
}
BLOCK_SIZE = 16
PASS_REL_ERROR = 1e-2


@dataclass
class Result:
    layer: str
    batch: int
    context: int
    q_len: int
    rel_error: float
    triton_ms: float
    reference_ms: float
    gb_per_s: float
    passed: bool


def make_inputs(batch, context, q_len, num_heads, num_kv_heads, head_dim, sliding_window, scale=1.0, device="cuda"):
    """Rows end at slightly different lengths; their blocks are scattered over the pool at random."""
    kv_lens = torch.tensor([context - 13 * b for b in range(batch)], dtype=torch.int32)
    blocks_per_row = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_row
    table = torch.randperm(num_blocks).view(batch, blocks_per_row).to(torch.int32)
    q_pos0 = kv_lens - q_len
    if sliding_window is not None:
        first_visible = (q_pos0 - sliding_window + 1).clamp_min(0)
        released = torch.arange(blocks_per_row)[None, :] < (first_visible // BLOCK_SIZE)[:, None]
        table[released] = -1
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device)
    q = torch.randn(batch, q_len, num_heads, head_dim, dtype=torch.bfloat16, device=device)
    q_lens = torch.full((batch,), q_len, dtype=torch.int32)
    if q_len > 8:  # prefill: left padding in every row but the first
        q_lens[1:] = q_len * 2 // 3
    index_args = [t.to(device) for t in (table, kv_lens, q_pos0, q_lens)]
    return q, k_cache, v_cache, *index_args


def visible_kv_bytes(kv_lens, q_len, num_kv_heads, head_dim, sliding_window) -> int:
    """K and V bytes of the keys that at least one query of each row sees."""
    keys = kv_lens.long()
    if sliding_window is not None:
        keys = keys.clamp_max(sliding_window + q_len - 1)
    return int(keys.sum()) * num_kv_heads * head_dim * 2 * torch.bfloat16.itemsize


def check_case(layer, batch, context, q_len, graph: bool = False) -> Result:
    import triton.testing

    shape = LAYERS[layer]
    args = make_inputs(batch, context, q_len, **shape)
    kwargs = dict(scale=shape["scale"], sliding_window=shape["sliding_window"])
    out = paged_attention(*args, **kwargs)
    ref = paged_attention_reference(*args, **kwargs)
    rel_error = float((out.float() - ref.float()).norm() / ref.float().norm())
    if graph:
        triton_ms = graph_ms(args, kwargs, out)
    else:
        triton_ms = triton.testing.do_bench(lambda: paged_attention(*args, **kwargs, out=out))
    reference_ms = triton.testing.do_bench(lambda: paged_attention_reference(*args, **kwargs))
    kv_bytes = visible_kv_bytes(args[4], q_len, shape["num_kv_heads"], shape["head_dim"], shape["sliding_window"])
    return Result(layer, batch, context, q_len, rel_error, triton_ms, reference_ms,
                  kv_bytes / (triton_ms * 1e-3) / 1e9, rel_error < PASS_REL_ERROR)


def graph_ms(args, kwargs, out) -> float:
    """One call's time inside a CUDA graph of calls over enough copies of the K/V pages (>= 256 MB in all) that none
    finds its pages in L2, as a decode step's layers do not: a decode step's view of the kernel (no launch gaps)."""
    from benchmarks.gemm_gpu_check import COPY_BYTES, graph_us

    q, k_cache, v_cache, *index = args
    copies = max(1, -(-COPY_BYTES // (2 * k_cache.numel() * k_cache.element_size())))
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(copies)]
    return graph_us(lambda q, kv: paged_attention(q, *kv, *index, **kwargs, out=out, validate=False), q, caches) / 1e3


def check_store_kv() -> bool:
    """store_kv (Triton) == store_kv_reference at the full layer's shape: 8 tokens, one of them padding."""
    num_kv_heads, head_dim = LAYERS["full"]["num_kv_heads"], LAYERS["full"]["head_dim"]
    caches = [torch.randn(64, BLOCK_SIZE, num_kv_heads, head_dim, device="cuda").bfloat16() for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    key, value = (torch.randn(8, num_kv_heads, head_dim, device="cuda") for _ in range(2))
    slots = torch.randperm(64 * BLOCK_SIZE, device="cuda")[:8]
    slots[3] = -1
    store_kv(key, value, *caches, slots)
    store_kv_reference(key, value, *expected, slots)
    return all(torch.equal(a, b) for a, b in zip(caches, expected))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", choices=list(LAYERS), default=list(LAYERS))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--contexts", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--q-lens", nargs="+", type=int, default=[1, 8], help="queries per row (decode 1, verify k+1)")
    parser.add_argument("--no-prefill", action="store_true", help="leave out the prefill cases of each layer")
    parser.add_argument("--prefill", nargs="+", default=["2:2048:512"], metavar="BATCH:CONTEXT:QUERIES",
                        help="prefill cases: CONTEXT keys, the last QUERIES of them this launch's (CONTEXT = "
                             "QUERIES: a prompt's own forward, no cached prefix)")
    parser.add_argument("--graph", action="store_true",
                        help="time each call inside a CUDA graph over copies of the pages (no launch gaps, no L2 "
                             "hits), as a decode step runs it, instead of triton's do_bench")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    import triton

    torch.manual_seed(0)
    store_kv_ok = check_store_kv()
    cases = list(product(args.layers, args.batch, args.contexts, args.q_lens))
    if not args.no_prefill:
        cases += [(layer, *map(int, case.split(":"))) for layer in args.layers for case in args.prefill]
    results = [check_case(*case, graph=args.graph and case[3] <= 32) for case in cases]
    print(f"{'layer':12} {'batch':>5} {'ctx':>5} {'T':>3} {'rel_err':>9} {'triton_ms':>9} {'ref_ms':>8} "
          f"{'GB/s':>7}  ok")
    for r in results:
        print(f"{r.layer:12} {r.batch:5d} {r.context:5d} {r.q_len:3d} {r.rel_error:9.2e} {r.triton_ms:9.4f} "
              f"{r.reference_ms:8.3f} {r.gb_per_s:7.0f}  {'yes' if r.passed else 'NO'}")
    print(f"store_kv exact: {'yes' if store_kv_ok else 'NO'}")
    all_pass = store_kv_ok and all(r.passed for r in results)
    print(json.dumps({"benchmark": "kernels_gpu_check", "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": triton.__version__, "store_kv_exact": store_kv_ok,
                      "all_pass": all_pass, "results": [asdict(r) for r in results]}))
    return 0 if all_pass else 1


if __name__ == "__main__":
    sys.exit(main())
