"""decode: plain greedy decoding, transformers (dynamic cache; static cache + torch.compile) vs hf_specdec, beside the bandwidth floor.

    python -m benchmarks.decode [--shapes gemma4-31b gemma4-e4b gemma4-26b-a4b step3p5] [--layers N] [--batch 1 8]
                                [--weights bf16 | fp8 | nf4 | int4] [--quick | --smoke]

Gemma 4 31B and E4B shapes with random bf16 weights (benchmarks/shapes.py; ``--layers`` cuts the depth and
is recorded in model_shape). Backends: ``hf_dynamic`` (``generate``, DynamicCache), ``hf_static_compile``
(``generate`` with a StaticCache, which transformers compiles with torch.compile on a GPU; on the CPU it runs
uncompiled and the row says ``compiled: false``; a failure is recorded as the row's ``skipped`` reason) and
``hf_specdec`` (``hf_specdec.enable``). tokens/s is steady-state decoding, prefill excluded: batch*(N-1) / (t(N) -
t(1)); ``first_token_ms`` is the median t(1), a whole call of one new token (the time to the first token: the call's
setup and the prompt's forward; the backends run one after the other, so a host's drift shows between them:
``benchmarks.ab_first_token`` times them in turn). ``floor_tokens_per_s`` = measured copy bandwidth / bytes streamed
per step (weights once, K/V of the context per row). Tokens are compared with ``hf_dynamic``; a mismatch
is reported with the reference's top-2 logit gap there (``near_tie`` when within 2 bf16 ulps, docs/architecture.md,
"Exactness").

``--weights fp8`` quantizes each target to FP8 first (benchmarks/shapes.py: transformers' FP8 layers, 128 x 128
blocks); the floor counts the stored bytes (one per weight plus the block scales). transformers' rows then run
its own FP8 layers, which quantize the activations too (W8A8, a GPU kernel; on the CPU they do not run and the
row says why): their tokens are a different product's and are not compared (``same_tokens`` empty).
``--weights nf4`` / ``int4`` quantize every linear layer but the LM head to 4 bits (bitsandbytes, torchao); both
sides run those layers' own forwards, so tokens are compared as with dense weights.
"""

from __future__ import annotations

import math

import torch

import hf_specdec
from benchmarks.common import bench_main, copy_bandwidth_gb_s, decode_rate, first_mismatch, free_device_memory
from benchmarks.shapes import WEIGHTS, floor_tokens_per_s, random_prompt, shape_name, target_for
from hf_specdec.compat import cache_argument

NAME = "decode"
BACKENDS = ("hf_dynamic", "hf_static_compile", "hf_specdec")
COLUMNS = ["model_shape", "weights", "backend", "batch", "tokens_per_s", "floor_tokens_per_s", "pct_of_floor",
           "speedup_vs_hf_dynamic", "first_token_ms", "same_tokens", "skipped"]
PRESETS = {
    "smoke": dict(shapes=["smoke-31b", "smoke-e4b"], batch=[1, 2], prompt=12, new_tokens=5),
    "quick": dict(layers=12, prompt=256, new_tokens=32, compile_shapes=["gemma4-31b"]),
}


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", nargs="+", default=["gemma4-31b", "gemma4-e4b"])
    parser.add_argument("--layers", type=int, default=None, help="cut every shape to this many layers")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1,
                        help="median of this many timed (1, N) pairs per row (targets whose prefill time varies)")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--compile-batches", type=int, nargs="+", default=None,
                        help="batch sizes that run hf_static_compile (default: all; each costs a compile)")
    parser.add_argument("--compile-shapes", nargs="+", default=None,
                        help="shapes that run hf_static_compile (default: all)")
    parser.add_argument("--weights", choices=WEIGHTS, default="bf16",
                        help="the targets' weights: dense in the bench dtype, quantized to FP8 (128 x 128 blocks), "
                             "or to 4 bits (bitsandbytes NF4, torchao int4)")


def run(args, progress) -> list[dict]:
    bandwidth = copy_bandwidth_gb_s(args.device)
    progress.total(len(args.shapes) * len(args.batch) * len(args.backends))
    rows = []
    for shape in args.shapes:
        model = target_for(shape, args.layers, args.device, args.dtype, args.weights)
        for batch in args.batch:
            rows += bench_batch(model, shape_name(shape, args.layers), batch, bandwidth, args, progress)
        del model
        free_device_memory()
    return rows


def bench_batch(model, model_shape: str, batch: int, bandwidth: float, args, progress) -> list[dict]:
    ids = random_prompt(batch, args.prompt, model.config.vocab_size, args.device)
    floor = floor_tokens_per_s(model, batch, args.prompt + args.new_tokens // 2, bandwidth)
    common = dict(model_shape=model_shape, weights=args.weights, batch=batch, k=None, prompt=args.prompt,
                  new_tokens=args.new_tokens, copy_gb_s=round(bandwidth, 1),
                  floor_tokens_per_s=floor["floor_tokens_per_s"], weight_gb=floor["weight_bytes"] / 1e9,
                  kv_gb=floor["kv_bytes"] / 1e9)
    rows, reference = [], None
    for backend in args.backends:
        row = dict(common, backend=backend, tokens_per_s=None, same_tokens=None, skipped=None)
        if backend == "hf_static_compile" and not _compiles(args, model_shape, batch):
            row["skipped"] = f"not run at this size (--compile-batches {args.compile_batches}, --compile-shapes " \
                             f"{args.compile_shapes}): each costs a compile"
        else:
            try:
                measured = MEASURE[backend](model, ids, args)
            except Exception as err:  # a baseline that does not run on this version/device is a result too
                row["skipped"] = f"{type(err).__name__}: {err}"[:300]
                measured = None
            if measured is not None and not _compared(args, backend):
                row.update(_timings(measured))
            elif measured is not None:
                reference = _fill(row, measured, reference)
        rows.append(row)
        progress.step(f"{model_shape} b{batch} {backend}")
    base = next((r["tokens_per_s"] for r in rows if r["backend"] == "hf_dynamic" and r["tokens_per_s"]), None)
    for r in rows:
        if r["tokens_per_s"]:
            r["pct_of_floor"] = 100 * r["tokens_per_s"] / r["floor_tokens_per_s"]
            r["speedup_vs_hf_dynamic"] = r["tokens_per_s"] / base if base else None
    return rows


def _compared(args, backend: str) -> bool:
    """Whether a row's tokens are compared: always with dense and 4-bit weights (the layers' own products on both
    sides); with FP8 weights only hf_specdec's rows among themselves (transformers' FP8 layers compute another
    product, W8A8)."""
    return args.weights != "fp8" or backend.startswith("hf_specdec")


def _compiles(args, model_shape: str, batch: int) -> bool:
    shape = model_shape.split("/")[0]
    return ((args.compile_batches is None or batch in args.compile_batches)
            and (args.compile_shapes is None or shape in args.compile_shapes))


def _timings(measured: dict) -> dict:
    """A row's fields from :func:`decode_rate`'s result: the decode rate, the time to the first token, any extras."""
    return dict(tokens_per_s=measured["tokens_per_s"], first_token_ms=measured["first_token_ms"],
                **measured.get("extra", {}))


def _fill(row: dict, measured: dict, reference):
    out = measured.pop("output")
    row.update(_timings(measured))
    sequences = out.sequences if hasattr(out, "sequences") else out
    if reference is None:
        row["same_tokens"] = True
        return (sequences, getattr(out, "logits", None))
    mismatch = first_mismatch(reference[0], sequences, reference[1])
    row["same_tokens"] = mismatch is None
    if mismatch:
        row["first_mismatch"] = mismatch
        row["near_tie"] = _near_tie(reference[1], mismatch, reference[0].shape[1])
    return reference


def _near_tie(logits, mismatch, width) -> bool:
    """Whether the reference's top-2 logits at the first mismatch are within 2 bf16 ulps of each other."""
    if logits is None or mismatch["top2_gap"] is None:
        return False
    step = mismatch["column"] - (width - len(logits))
    top = float(logits[step].float().abs().max())
    ulp = 2.0 ** (math.floor(math.log2(max(top, 1e-30))) - 7)
    return mismatch["top2_gap"] <= 2 * ulp


def _generate_kwargs(ids, n: int, **extra) -> dict:
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **extra)


def measure_hf_dynamic(model, ids, args) -> dict:
    def generate(n):
        return model.generate(**_generate_kwargs(ids, n, return_dict_in_generate=True, output_logits=True))

    return decode_rate(generate, ids.shape[0], args.new_tokens, repeats=args.repeats)


def measure_hf_static_compile(model, ids, args) -> dict:
    from transformers import StaticCache

    # One cache of one size for every call: the compiled graph is reused across lengths (no recompile).
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + args.new_tokens + 1)

    def generate(n):
        cache.reset()
        return model.generate(**_generate_kwargs(ids, n, **{cache_argument(model): cache}))

    result = decode_rate(generate, ids.shape[0], args.new_tokens, repeats=args.repeats)
    result["extra"] = {"compiled": model.device.type == "cuda"}
    return result


def measure_hf_specdec(model, ids, args) -> dict:
    hf_specdec.enable(model)
    try:
        return decode_rate(lambda n: model.generate(**_generate_kwargs(ids, n)), ids.shape[0], args.new_tokens,
                           repeats=args.repeats)
    finally:
        hf_specdec.disable(model)


MEASURE = {"hf_dynamic": measure_hf_dynamic, "hf_static_compile": measure_hf_static_compile,
           "hf_specdec": measure_hf_specdec}

main = bench_main(__import__(__name__, fromlist=["NAME"]))

if __name__ == "__main__":
    raise SystemExit(main())
