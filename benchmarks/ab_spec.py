"""Plain and speculative decoding of the bundled tiny family under two or more settings of a module attribute, in one
process, in turn.

    python -m benchmarks.ab_spec --set hf_specdec.kernels.skinny_gemm.FP32_ROWS_KERNEL=False,True
                                 [--members tiny-gemma4 tiny-step3p5] [--batch 1 4] [--rounds 3]
                                 [--mtp-k 4] [--new-tokens 128] [--repeats 3] [--device cuda]

:mod:`benchmarks.ab_decode` for the speculative modes: each member of the family is loaded once (fp32, as
``benchmarks.e2e_tiny`` runs it) with its drafters, then every round times each value in turn, with the model's CUDA
graphs (its drafters' too) released between values, for hf_specdec plain decoding and every fixed-k mode of
``e2e_tiny`` (Gemma 4 MTP at each ``--mtp-k``, DFlash at its block, Step 3.5 MTP at k = 1, 2, 3; no ``"auto"`` rows:
a k chosen from timed rounds would move between values for reasons of its own). The tiny family's steps take
0.2-1 ms, so the machine's speed moves them by up to 2x across processes (docs/perf_log.md, sessions 37-38):
values timed in turn in one process, over several rounds, are what makes a 10% change readable. Prints one JSON line
per measurement, then a table of the median per value against the first value and whether each value's tokens equal
the first's. Nothing is appended to ``benchmarks/results``: keep the printout as a log there.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from benchmarks.ab_decode import parse_setting, summary
from benchmarks.common import decode_rate
from benchmarks.e2e_tiny import MEMBERS, _prompts, _runs
from hf_specdec.assets import asset_path, available_assets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", required=True, dest="setting", help="MODULE.ATTRIBUTE=V1,V2,...")
    parser.add_argument("--members", nargs="+", default=list(MEMBERS), choices=MEMBERS)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mtp-k", type=int, nargs="+", default=[4], help="k of the Gemma 4 MTP assistant rows")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="median of this many timed (1, N) pairs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    module, attribute, values = parse_setting(args.setting, "ab_spec")
    original = getattr(module, attribute)
    print(json.dumps(dict(bench="ab_spec", device=torch.cuda.get_device_name() if args.device.startswith("cuda")
                          else args.device, setting=args.setting,
                          command=" ".join(["python -m benchmarks.ab_spec", *(argv or sys.argv[1:])]))), flush=True)
    rows = []
    try:
        for name in [m for m in args.members if m in available_assets()]:
            rows += _compare(name, module, attribute, values, args)
    finally:
        setattr(module, attribute, original)
    summary(rows, values, "case")
    return 0


def _compare(name: str, module, attribute: str, values: list, args) -> list[dict]:
    """Every round: each value in turn, each batch, plain then each speculative mode of ``name``."""
    model = AutoModelForCausalLM.from_pretrained(asset_path(name), dtype=torch.float32).to(args.device).eval()
    model.generation_config.eos_token_id = None  # every row decodes the full length
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))
    modes = [("plain", {})] + [(f"{backend.removeprefix('hf_specdec_')} k={k}", extra) for backend, k, extra in
                               _runs(name, SimpleNamespace(mtp_k=args.mtp_k, auto=False, device=args.device))]
    hf_specdec.enable(model)
    rows, first_tokens = [], {}
    try:
        for round_ in range(args.rounds):
            for value in values:
                setattr(module, attribute, value)
                model._hf_specdec.graph_store.release()  # captured under the last value
                for batch in args.batch:
                    inputs = _prompts(tokenizer, batch, args.device)
                    for mode, extra in modes:
                        rows.append(_measure(model, inputs, batch, extra, f"{name} {mode}", value, round_,
                                             first_tokens, values[0], args))
                        print(json.dumps(rows[-1]), flush=True)
    finally:
        hf_specdec.disable(model)
    return rows


def _measure(model, inputs, batch, extra, case, value, round_, first_tokens, first_value, args) -> dict:
    measured = decode_rate(lambda n: model.generate(**inputs, max_new_tokens=n, do_sample=False, **extra),
                           batch, args.new_tokens, repeats=args.repeats)
    tokens = measured["output"].cpu()
    first_tokens.setdefault((case, batch, repr(value)), tokens)
    first = first_tokens.get((case, batch, repr(first_value)), tokens)
    stats = hf_specdec.last_generation_stats(model)
    return dict(case=case, batch=batch, value=repr(value), round=round_,
                tokens_per_s=round(measured["tokens_per_s"], 1), tau=round(stats.mean_accepted_length, 3),
                same_tokens_as_first=bool(torch.equal(first, tokens)))


if __name__ == "__main__":
    raise SystemExit(main())
