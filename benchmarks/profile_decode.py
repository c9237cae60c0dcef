"""Where a decode or verify step's time goes: wall time per step, then the top kernels and host calls
(torch.profiler), for a target of any benchmark shape (default the Gemma-4-31B shape) driven through the
ModelRunner with CUDA graphs on.

    PYTHONPATH=. python -m benchmarks.profile_decode [--shape gemma4-31b] [--layers 12] [--batch 1] [--k 0] [--eager]

``--k 0``: decode steps (1 token per row); ``--k N``: verify steps of N+1 tokens per row.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="gemma4-31b", help="a shape of benchmarks/shapes.py")
    parser.add_argument("--layers", type=int, default=12, help="cut the shape to this many layers (0: full depth)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--k", type=int, default=0)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs: every kernel launch shows up")
    parser.add_argument("--rows", type=int, default=18, help="rows of each profiler table")
    parser.add_argument("--weights", default="bf16", help="the target's weights (benchmarks/shapes.py WEIGHTS)")
    args = parser.parse_args()
    import hf_specdec
    from benchmarks.shapes import target_for
    from hf_specdec.runtime import ModelRunner

    target = target_for(args.shape, args.layers or None, "cuda", torch.bfloat16, args.weights)
    model = hf_specdec.enable(target, cuda_graphs=not args.eager)
    state = model._hf_specdec
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device="cuda")
    q = args.k + 1
    with torch.inference_mode():
        runner = ModelRunner(model, state.layout, state.cache_config, None if args.eager else state.graph_store)
        runner.start([args.prompt] * args.batch, args.steps * q + 64, lookahead=q)
        runner.forward(ids, [args.prompt] * args.batch, keep_logits=1)
        runner.commit([args.prompt] * args.batch)
        step_ids = ids[:, -q:]

        def step():
            out = runner.forward(step_ids, [q] * args.batch, keep_logits=0 if args.k else 1)
            logits = out.logits.float()
            tokens = logits.argmax(-1)
            tokens.tolist()  # the loop's one host sync
            runner.commit([n for n in runner.cache.seq_lens])

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - start) / args.steps
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                step()
            torch.cuda.synchronize()
        runner.finish()
    print(f"batch {args.batch}, q_len {q}, {'eager' if args.eager else 'graphs'}: {per_step * 1e3:.2f} ms per step (wall)")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
