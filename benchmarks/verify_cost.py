"""verify_cost: time of one hf_specdec verify step (k+1 tokens per row) / one plain decode step.

    python -m benchmarks.verify_cost [--shape gemma4-31b | gemma4-26b-a4b | step3p5] [--layers N] [--k 1 3 7 15]
                                     [--batch 1 8] [--repeats 3] [--weights bf16 | fp8 | nf4 | int4] [--no-ahead]
                                     [--quick | --smoke]

Method: both steps are timed through ``generate`` as users run it, so the loop's own work per step (and
CUDA graphs, when the loop uses them) is included. The verify step runs with ``FixedDrafter``
(benchmarks/drafters.py), which proposes the last token k times at no cost: a speculative step is then
one verify forward of k+1 tokens per row plus acceptance, commit and emission. The decode step is
hf_specdec's plain loop. Each step time comes from two calls, N and 1 new tokens, and
SpecStats.num_target_forwards: (t(N) - t(1)) / (forwards(N) - forwards(1)), so prefill cancels out; the
median of ``--repeats`` such pairs (single pairs of 24 steps read k=7 at 1.39x and k=15 at 1.07x in one run).
On the GPU the verify rounds run one round ahead of the host, as the bundled drafters' greedy rounds do and as
the plain decode steps they are compared with do (``ahead: true`` in the records); ``--no-ahead`` times rounds
that each wait for the host to read the round before (the method of the records without the field).
``ratio`` = verify step / decode step. (Random weights: drafts are rejected, so tokens/s of the verify rows
is that of a step that commits one token, not a speculative speed.) ``--weights fp8`` (``nf4``, ``int4``) quantizes the
target first (benchmarks/shapes.py); each row also gives the bytes a decode step streams (``weight_gb``).
"""

from __future__ import annotations

import hf_specdec
from benchmarks.common import bench_main, decode_rate, free_device_memory
from benchmarks.drafters import FixedDrafter
from benchmarks.shapes import WEIGHTS, random_prompt, shape_name, streamed_bytes_per_step, target_for

NAME = "verify_cost"
COLUMNS = ["model_shape", "weights", "backend", "batch", "k", "ahead", "step_ms", "ratio_to_decode", "tokens_per_s"]
PRESETS = {
    "smoke": dict(shape="smoke-31b", k=[1, 3], batch=[1, 2], prompt=12, new_tokens=6, repeats=1),
    "quick": dict(layers=12, prompt=256, new_tokens=64, k=[1, 3, 7, 15], repeats=3),
}


def add_arguments(parser) -> None:
    parser.add_argument("--shape", default="gemma4-31b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 3, 7, 15])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="median of this many timed (1, N) pairs")
    parser.add_argument("--no-ahead", dest="ahead", action="store_false",
                        help="verify rounds wait for the host to read the round before (by default they run one "
                             "round ahead on the GPU, as the bundled drafters' greedy rounds do)")
    parser.add_argument("--weights", choices=WEIGHTS, default="bf16",
                        help="the target's weights: dense in the bench dtype, quantized to FP8 (128 x 128 blocks), "
                             "or to 4 bits (bitsandbytes NF4, torchao int4)")


def run(args, progress) -> list[dict]:
    model = hf_specdec.enable(target_for(args.shape, args.layers, args.device, args.dtype, args.weights))
    progress.total(len(args.batch) * (1 + len(args.k)))
    rows = []
    for batch in args.batch:
        ids = random_prompt(batch, args.prompt, model.config.vocab_size, args.device)
        weight_gb = streamed_bytes_per_step(model, batch, args.prompt)["weight_bytes"] / 1e9
        common = dict(model_shape=shape_name(args.shape, args.layers), weights=args.weights, batch=batch,
                      prompt=args.prompt, weight_gb=weight_gb)
        decode = _step(model, ids, args.new_tokens, args.repeats, {})
        rows.append(dict(common, backend="hf_specdec", k=None, step_ms=decode["step_ms"], ratio_to_decode=1.0,
                         tokens_per_s=decode["tokens_per_s"]))
        progress.step(f"b{batch} decode")
        for k in args.k:
            verify = _step(model, ids, args.new_tokens, args.repeats,
                           dict(assistant_model=FixedDrafter(k, ahead=args.ahead)))
            rows.append(dict(common, backend="hf_specdec_verify", k=k, ahead=args.ahead, step_ms=verify["step_ms"],
                             ratio_to_decode=verify["step_ms"] / decode["step_ms"],
                             tokens_per_s=verify["tokens_per_s"]))
            progress.step(f"b{batch} k{k}")
    del model
    free_device_memory()
    return rows


def _step(model, ids, new_tokens: int, repeats: int, extra: dict) -> dict:
    def generate(n):
        return model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=n, do_sample=False, **extra)

    forwards = lambda _out: hf_specdec.last_generation_stats(model).num_target_forwards  # noqa: E731
    result = decode_rate(generate, ids.shape[0], new_tokens, stats=forwards, repeats=repeats)
    result.pop("output")
    return result


main = bench_main(__import__(__name__, fromlist=["NAME"]))

if __name__ == "__main__":
    raise SystemExit(main())
