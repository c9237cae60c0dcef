"""The time to the first token, hf_specdec against transformers, on the same weights, in turn in one process.

    python -m benchmarks.ab_first_token [--shapes gemma4-e2b gemma4-e4b:12 ...] [--prompts 128 512 2048]
                                        [--batch 1] [--rounds 8] [--after-new-tokens 1] [--device cuda]

Per shape (``SHAPE`` or ``SHAPE:LAYERS``, as ``benchmarks.shapes`` names them) the target is built once; then each
round times one whole ``generate(max_new_tokens=1)`` call (setup, the prompt's forward, its token on the host) with
``hf_specdec.enable`` and one without (in the other order every other round), each after an untimed call of its own
(so graphs, allocations and kernels are warm) of ``--after-new-tokens`` new tokens (default 1; 16 is ``decode``'s
pattern, a one-token call after a longer one). A call this short is host-bound, and a lent GPU machine's host moves
a call's time by 1.5x over tens of seconds: two runs one after the other (``decode``'s ``first_token_ms``) can
disagree on which is faster; calls in turn see the same drift.
Prints one JSON line per (shape, prompt) and a table of medians; nothing is appended to
``benchmarks/results``: keep the printout as a log there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hf_specdec
from benchmarks.common import free_device_memory
from benchmarks.shapes import random_prompt, target_for


def first_token_ms(model, ids: torch.Tensor, new_tokens: int = 1) -> float:
    """Wall time of one ``generate`` call of ``new_tokens`` new tokens (its tokens read on the host), in ms."""
    mask = torch.ones_like(ids)
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False).tolist()
    return (time.perf_counter() - start) * 1e3


def measure(model, ids: torch.Tensor, rounds: int, after_new_tokens: int = 1) -> dict:
    """Medians over ``rounds`` of the two calls, in turn, hf_specdec first in even rounds and second in odd ones (each
    timed call follows an untimed one of ``after_new_tokens`` new tokens)."""
    ours, theirs = [], []

    def mine():
        hf_specdec.enable(model)
        try:
            first_token_ms(model, ids, after_new_tokens)
            ours.append(first_token_ms(model, ids))
        finally:
            hf_specdec.disable(model)

    def base():
        first_token_ms(model, ids, after_new_tokens)
        theirs.append(first_token_ms(model, ids))

    for i in range(rounds):  # ABBA: neither always runs first
        for measure_one in ((mine, base) if i % 2 == 0 else (base, mine)):
            measure_one()
    mine, base = statistics.median(ours), statistics.median(theirs)
    return dict(hf_specdec_ms=round(mine, 2), transformers_ms=round(base, 2), speedup=round(base / mine, 3),
                hf_specdec_all=[round(t, 1) for t in ours], transformers_all=[round(t, 1) for t in theirs])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab_first_token", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["gemma4-e2b", "gemma4-e4b"])
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--after-new-tokens", type=int, default=1,
                        help="new tokens of the untimed call before each timed one")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    rows = []
    for spec in args.shapes:
        shape, _, layers = spec.partition(":")
        model = target_for(shape, int(layers) if layers else None, args.device, dtype)
        for prompt in args.prompts:
            ids = random_prompt(args.batch, prompt, model.config.vocab_size, args.device, seed=1)
            row = dict(bench="ab_first_token", gpu=gpu, model_shape=spec, batch=args.batch, prompt=prompt,
                       rounds=args.rounds, after_new_tokens=args.after_new_tokens,
                       **measure(model, ids, args.rounds, args.after_new_tokens))
            print(json.dumps(row), flush=True)
            rows.append(row)
        del model
        free_device_memory()
    print(f"{'model_shape':16} {'prompt':>6} {'hf_specdec_ms':>13} {'transformers_ms':>15} {'speedup':>7}")
    for r in rows:
        print(f"{r['model_shape']:16} {r['prompt']:6d} {r['hf_specdec_ms']:13.1f} {r['transformers_ms']:15.1f} "
              f"{r['speedup']:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
