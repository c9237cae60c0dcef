"""One expert layer graph-timed under two or more settings of a module attribute, in one process, in turn.

    python -m benchmarks.moe_kernel_ab --set hf_specdec.kernels.fp8_moe.W8A8_STACKED_GATE_UP=False,True
                                       [--layer gemma4-26b-a4b] [--weights w8a8] [--tokens 1 4 8] [--rounds 3]

The kernel-level companion of ``benchmarks.ab_decode``: the layer of ``benchmarks.moe_gpu_check`` (``--layer``,
``--weights`` as there) with its default tiles, captured in a CUDA graph per value and replayed on fresh routings
(``moe_gpu_check.graph_time``); every round times each value in turn, and the table gives the best of the rounds'
medians per value, with the largest difference over the rounds of each value's output from the first value's (0: the
same bits). Prints one JSON line per measurement; nothing is appended to ``benchmarks/results``: keep the printout
as a log.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from benchmarks.ab_decode import parse_setting
from benchmarks.moe_gpu_check import SHAPES, Layer, graph_time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", required=True, dest="setting", help="MODULE.ATTRIBUTE=V1,V2,...")
    parser.add_argument("--layer", choices=sorted(SHAPES), default="gemma4-26b-a4b")
    parser.add_argument("--weights", choices=["bf16", "fp8", "w8a8"], default="w8a8")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_kernel_ab: needs a CUDA GPU (the layer is timed in CUDA graphs)")
    module, attribute, values = parse_setting(args.setting, "moe_kernel_ab")
    original = getattr(module, attribute)
    print(json.dumps(dict(bench="moe_kernel_ab", device=torch.cuda.get_device_name(), setting=args.setting,
                          command=" ".join(["python -m benchmarks.moe_kernel_ab", *(argv or sys.argv[1:])]))),
          flush=True)
    layer = Layer(args.layer, args.weights)
    best: dict[tuple[int, str], float] = {}
    differs: dict[tuple[int, str], float] = {}
    try:
        for tokens in args.tokens:
            inputs = layer.inputs(tokens)
            outputs = {}
            for round_ in range(args.rounds):
                for value in values:
                    setattr(module, attribute, value)
                    args_ = [t.clone() for t in inputs]
                    outputs[repr(value)] = layer.call(args_).float()
                    times, _ = graph_time(layer, args_, lambda: layer.call(args_))
                    median = statistics.median(times)
                    key = (tokens, repr(value))
                    best[key] = min(best.get(key, float("inf")), median)
                    diff = (outputs[repr(value)] - outputs[repr(values[0])]).abs().max().item()
                    differs[key] = max(differs.get(key, 0.0), diff)
                    print(json.dumps(dict(tokens=tokens, value=repr(value), round=round_, median_us=round(median, 2),
                                          max_abs_diff_from_first=diff)), flush=True)
    finally:
        setattr(module, attribute, original)
    print(f"\n{'tokens':>6}  " + "".join(f"{repr(v):>26}" for v in values))
    for tokens in args.tokens:
        cells = [f"{best[tokens, repr(v)]:8.2f} us (diff {differs[tokens, repr(v)]:.1e})" for v in values]
        print(f"{tokens:>6}  " + "".join(f"{c:>26}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
