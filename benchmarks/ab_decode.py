"""Plain greedy decoding of one model under two or more settings of a module attribute, in one process, in turn.

    python -m benchmarks.ab_decode --set hf_specdec.kernels.skinny_gemm.SPLIT_K=False,True
                                   [--shapes gemma4-26b-a4b gemma4-31b:12 ...] [--batch 1 8] [--rounds 2]
                                   [--prompt 512] [--new-tokens 128] [--repeats 3] [--weights bf16] [--device cuda]

An A/B of a change that a module attribute switches (``MODULE.ATTRIBUTE=V1,V2,...``, each value a Python literal):
each shape's target is built once (``SHAPE`` or ``SHAPE:LAYERS``, as ``benchmarks.shapes`` names them), then every
round times each value in turn with ``hf_specdec.enable`` around it (so the CUDA graphs of one value are released
before the next), the tokens/s of ``benchmarks.decode``'s hf_specdec row (steady state, median of ``--repeats``).
Timing variants in turn on one machine is what makes a few-percent change readable: two calls, or two machines,
move more than that. Prints one JSON line per measurement, then a table of the median per value against the
first value and whether each value's tokens equal the first's (bf16 may flip a greedy token at a near-tie).
Nothing is appended to ``benchmarks/results``: keep the printout as a log there.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import sys

import torch

from benchmarks.common import copy_bandwidth_gb_s, free_device_memory
from benchmarks.decode import measure_hf_specdec
from benchmarks.shapes import WEIGHTS, floor_tokens_per_s, random_prompt, target_for


def parse_setting(text: str, bench: str = "ab_decode") -> tuple[object, str, list]:
    """``MODULE.ATTRIBUTE=V1,V2,...`` -> (module, attribute, [values]); errors (of ``bench``) name the fix."""
    target, sep, values = text.partition("=")
    module_name, _, attribute = target.rpartition(".")
    if not sep or not module_name or not attribute or not values:
        raise SystemExit(f"{bench}: --set takes MODULE.ATTRIBUTE=V1,V2 (e.g. "
                         f"hf_specdec.kernels.skinny_gemm.SPLIT_K=False,True), got {text!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise SystemExit(f"{bench}: --set names module {module_name!r}, which does not import: {error}")
    if not hasattr(module, attribute):
        raise SystemExit(f"{bench}: module {module_name} has no attribute {attribute!r} to set")
    try:
        parsed = [ast.literal_eval(v.strip()) for v in values.split(",")]
    except (ValueError, SyntaxError):
        raise SystemExit(f"{bench}: the values of --set must be Python literals separated by commas, got {values!r}")
    if len(parsed) < 2:
        raise SystemExit(f"{bench}: --set needs two values or more to compare, got {values!r}")
    return module, attribute, parsed


def parse_shape(text: str) -> tuple[str, int | None]:
    shape, _, layers = text.partition(":")
    return shape, int(layers) if layers else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", required=True, dest="setting", help="MODULE.ATTRIBUTE=V1,V2,...")
    parser.add_argument("--shapes", nargs="+", default=["gemma4-26b-a4b", "gemma4-31b:12"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", choices=WEIGHTS, default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="default: bfloat16 on CUDA, float32 elsewhere")
    args = parser.parse_args(argv)
    module, attribute, values = parse_setting(args.setting)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    original = getattr(module, attribute)
    bandwidth = copy_bandwidth_gb_s(args.device)
    print(json.dumps(dict(bench="ab_decode", device=torch.cuda.get_device_name() if args.device.startswith("cuda")
                          else args.device, copy_gb_s=round(bandwidth, 1), setting=args.setting,
                          command=" ".join(["python -m benchmarks.ab_decode", *(argv or sys.argv[1:])]))), flush=True)
    rows = []
    try:
        for spec in args.shapes:
            shape, layers = parse_shape(spec)
            model = target_for(shape, layers, args.device, dtype, args.weights)
            for batch in args.batch:
                rows += _compare(model, spec, batch, module, attribute, values, bandwidth, args)
            del model
            free_device_memory()
    finally:
        setattr(module, attribute, original)
    summary(rows, values)
    return 0


def _compare(model, spec, batch, module, attribute, values, bandwidth, args) -> list[dict]:
    ids = random_prompt(batch, args.prompt, model.config.vocab_size, args.device)
    floor = floor_tokens_per_s(model, batch, args.prompt + args.new_tokens // 2, bandwidth)["floor_tokens_per_s"]
    rows, first_tokens = [], {}
    for round_ in range(args.rounds):
        for value in values:
            setattr(module, attribute, value)
            measured = measure_hf_specdec(model, ids, args)
            tokens = measured["output"]
            first_tokens.setdefault(repr(value), tokens)
            row = dict(shape=spec, batch=batch, value=repr(value), round=round_,
                       tokens_per_s=round(measured["tokens_per_s"], 1),
                       pct_of_floor=round(100 * measured["tokens_per_s"] / floor, 1),
                       same_tokens_as_first=bool(torch.equal(first_tokens[repr(values[0])].cpu(), tokens.cpu())))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def summary(rows: list[dict], values: list, key: str = "shape") -> None:
    """The table: per (``key``, batch), each value's median tokens/s and its ratio to the first value's, and whether
    every measurement gave the first value's tokens."""
    print(f"\n{key:<22}{'batch':>6}  " + "".join(f"{repr(v):>18}" for v in values) + "  same tokens")
    for case in dict.fromkeys((r[key], r["batch"]) for r in rows):
        cells, same = [], True
        base = None
        for value in values:
            picked = [r for r in rows if (r[key], r["batch"]) == case and r["value"] == repr(value)]
            median = statistics.median(r["tokens_per_s"] for r in picked)
            base = base or median
            cells.append(f"{median:>10.1f} ({median / base:.3f})")
            same &= all(r["same_tokens_as_first"] for r in picked)
        print(f"{case[0]:<22}{case[1]:>6}  " + "".join(f"{c:>18}" for c in cells) + f"  {same}")

if __name__ == "__main__":
    raise SystemExit(main())
