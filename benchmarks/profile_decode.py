"""Where a decode or verify step's time goes: wall time per step, then the top kernels and host calls
(torch.profiler), for a target of any benchmark shape (default the Gemma-4-31B shape) driven through the
ModelRunner with CUDA graphs on.

    PYTHONPATH=. python -m benchmarks.profile_decode [--shape gemma4-31b] [--layers 12] [--batch 1] [--k 0] [--eager]

``--k 0``: decode steps (1 token per row); ``--k N``: verify steps of N+1 tokens per row. ``--prefill``: the
prompt's forward instead (eager, as a request's first forward runs), with the host's own time per Python function
(cProfile, sorted by time spent in the function itself) beside the profiler's tables.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
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
    parser.add_argument("--prefill", action="store_true", help="profile the prompt's forward, not decode steps")
    args = parser.parse_args()
    import hf_specdec
    from benchmarks.shapes import target_for
    from hf_specdec.runtime import ModelRunner

    target = target_for(args.shape, args.layers or None, "cuda", torch.bfloat16, args.weights)
    model = hf_specdec.enable(target, cuda_graphs=not args.eager)
    state = model._hf_specdec
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device="cuda")
    if args.prefill:
        return _profile_prefill(model, state, ids, args)
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


def _profile_prefill(model, state, ids, args) -> int:
    from torch.profiler import ProfilerActivity, profile

    from hf_specdec.runtime import ModelRunner

    lens = [args.prompt] * args.batch
    runner = ModelRunner(model, state.layout, state.cache_config, state.graph_store)

    def prefill():
        runner.start(lens, 64, lookahead=1)
        out = runner.forward(ids, lens, keep_logits=1, prefill=True)
        out.logits.argmax(-1).tolist()  # as a request's first token reaches the host
        runner.finish()

    wall = _walls(prefill, args.steps)
    with torch.inference_mode():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                prefill()
            torch.cuda.synchronize()
        host = cProfile.Profile()
        host.enable()
        for _ in range(4):
            prefill()
        host.disable()
    print(f"prefill batch {args.batch} x {args.prompt} tokens: {wall:.2f} ms (wall, median of {args.steps})")
    print(f"kernel time {_kernel_us(prof) / 4 / 1e3:.2f} ms a prefill")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(45)
    print("host time per function, 4 prefills under cProfile (which inflates each call by a few us):")
    print(text.getvalue())
    import hf_specdec
    from benchmarks.ab_first_token import first_token_ms

    def first_token():
        first_token_ms(model, ids)

    whole = _walls(first_token, args.steps)
    host = cProfile.Profile()
    host.enable()
    for _ in range(4):
        first_token()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(60)
    print(f"whole generate(max_new_tokens=1) call: {whole:.2f} ms (wall, median); 4 calls under cProfile:")
    print(text.getvalue())
    hf_specdec.disable(model)
    forward = _walls(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1).logits.argmax(-1).tolist(),
                     args.steps)
    print(f"transformers' forward of the same prompt: {forward:.2f} ms (wall, median); its whole generate call: "
          f"{_walls(first_token, args.steps):.2f} ms")
    return 0


def _kernel_us(prof) -> float:
    """The device's own time in ``prof``: its kernels and copies (the events on the device; an operator's entry,
    e.g. ``aten::mm``, counts its kernels' time again), as the table's "Self CUDA time total" sums it."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type != DeviceType.CPU)


def _walls(fn, n: int) -> float:
    """Median wall time of ``n`` calls of ``fn`` after three, in ms."""
    walls = []
    with torch.inference_mode():
        for i in range(3 + n):
            start = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - start)
    walls = sorted(walls[3:])
    return walls[len(walls) // 2] * 1e3


if __name__ == "__main__":
    raise SystemExit(main())
