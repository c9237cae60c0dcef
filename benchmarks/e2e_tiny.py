"""e2e_tiny: the bundled tiny trained family end to end, plain vs each speculative mode, real tau and speed-up.

    python -m benchmarks.e2e_tiny [--batch 1 4] [--new-tokens 128] [--repeats 3] [--quick | --smoke]

Prompts are the bundled held-out snippets (code no member was trained on). Rows per family member
(float32): transformers ``generate`` (hf_dynamic), hf_specdec plain, and every bundled drafter (tiny Gemma 4:
the MTP assistant at several k and DFlash when bundled; tiny Step 3.5: its own MTP layers, k = 1..3; each mode also
with ``num_speculative_tokens="auto"``, k chosen per round; those rows get five warm-up calls instead of one: the
controller times its rounds there and, on the GPU where no k gains much, plain decoding in one call, as a user's
first calls of a model at a batch size would, and later calls start from those timings; a row whose later calls
decode plainly, where no k beat plain decoding, shows a tau of 1).
Greedy, no early stop at EOS (every row decodes the full length); every hf_specdec row is checked token for
token against transformers. tokens/s is steady state, prefill excluded: batch*(N-1) / (t(N) - t(1)), the
median of ``--repeats`` timed pairs (a call lasts tens of milliseconds: single pairs of the same row moved by
up to 45% between two runs). ``--rounds R`` times a member's hf_specdec rows in turn R times and keeps each row's
median round: rows timed one after the other also measure the host's drift between them (an "auto" row against
fixed k at the same k and tau ran 1.7x slower, and another 1.25x faster, in one run on a lent H200). Transformers'
row is timed once, before them; an "auto" row keeps its round timings from one round to the next, as a user's later
calls would.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from benchmarks.common import AUTO_WARMUPS, bench_main, decode_rate, k_value
from hf_specdec.assets import asset_path, available_assets, held_out_snippets

NAME = "e2e_tiny"
COLUMNS = ["model_shape", "backend", "batch", "k", "tokens_per_s", "tau", "speedup", "same_tokens"]
PRESETS = {
    "smoke": dict(batch=[2], new_tokens=8, mtp_k=[4, "auto"], repeats=1),
    "quick": dict(batch=[1, 4], new_tokens=64),
}
MEMBERS = ("tiny-gemma4", "tiny-step3p5")


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="median of this many timed (1, N) pairs")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the hf_specdec rows of a member and batch in turn this many times, each row's "
                             "speed the median over them: the host sets these rows' pace, and its speed drifts by "
                             "up to 2x over a run, so rows timed one after the other compare that drift too")
    parser.add_argument("--mtp-k", type=k_value, nargs="+", default=[2, 4, 7, "auto"],
                        help="k of the Gemma 4 MTP assistant rows (\"auto\": chosen per round)")
    parser.add_argument("--no-auto", dest="auto", action="store_false",
                        help="leave out the num_speculative_tokens=\"auto\" rows of DFlash and Step 3.5 MTP")


    parser.add_argument("--members", nargs="+", default=list(MEMBERS), choices=MEMBERS)


def _prompts(tokenizer, batch: int, device):
    texts = [s["text"][:200] for s in held_out_snippets()]
    texts = (texts * batch)[:batch]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True).to(device)


def _runs(model_name: str, args):
    """(backend name, k, generate kwargs) of each speculative configuration for a family member."""
    if model_name == "tiny-gemma4":
        if "tiny-gemma4-assistant" in available_assets():
            assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-assistant"),
                                                                        dtype=torch.float32).to(args.device)
            for k in args.mtp_k:
                yield "hf_specdec_mtp", k, dict(assistant_model=assistant, num_speculative_tokens=k)
        if "tiny-gemma4-dflash" in available_assets():
            drafter = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-dflash"),
                                                                      dtype=torch.float32).to(args.device)
            k = drafter.block_size - 1  # its default, fixed (a greedy call without k chooses it per round)
            yield "hf_specdec_dflash", k, dict(assistant_model=drafter, num_speculative_tokens=k)
            if args.auto:
                yield "hf_specdec_dflash", "auto", dict(assistant_model=drafter, num_speculative_tokens="auto")
    elif model_name == "tiny-step3p5":
        for k in (1, 2, 3, "auto") if args.auto else (1, 2, 3):
            yield "hf_specdec_mtp", k, dict(spec_mode="mtp", num_speculative_tokens=k)


def bench_member(name: str, batch: int, args) -> list[dict]:
    model = AutoModelForCausalLM.from_pretrained(asset_path(name), dtype=torch.float32).to(args.device).eval()
    model.generation_config.eos_token_id = None  # every row decodes the full length
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))
    inputs = _prompts(tokenizer, batch, args.device)

    def speed(**extra):
        return decode_rate(lambda n: model.generate(**inputs, max_new_tokens=n, do_sample=False, **extra),
                           batch, args.new_tokens, repeats=args.repeats,
                           warmups=AUTO_WARMUPS if extra.get("num_speculative_tokens") == "auto" else 1)

    plain = speed()
    reference, base = plain["output"], plain["tokens_per_s"]
    rows = [dict(model_shape=name, backend="hf_dynamic", batch=batch, k=None, tokens_per_s=base, tau=1.0,
                 speedup=1.0, same_tokens=True)]
    hf_specdec.enable(model)
    configs = [("hf_specdec", None, {})] + list(_runs(name, args))
    timings: list[list[dict]] = [[] for _ in configs]
    for _ in range(max(1, args.rounds)):  # every row once a round, in turn (--rounds)
        for (_, _, extra), times in zip(configs, timings):
            measured = speed(**extra)
            times.append(dict(measured, tau=hf_specdec.last_generation_stats(model).mean_accepted_length))
    for (backend, k, _), times in zip(configs, timings):
        measured = sorted(times, key=lambda t: t["tokens_per_s"])[len(times) // 2]
        rows.append(dict(model_shape=name, backend=backend, batch=batch, k=k, tokens_per_s=measured["tokens_per_s"],
                         tau=measured["tau"], speedup=measured["tokens_per_s"] / base, rounds=len(times),
                         same_tokens=all(torch.equal(t["output"], reference) for t in times)))
    return rows


def run(args, progress) -> list[dict]:
    if args.rounds < 1:
        raise SystemExit(f"{NAME}: --rounds takes a positive number of rounds, got {args.rounds}")
    members = [m for m in args.members if m in available_assets()]
    progress.total(len(members) * len(args.batch))
    rows = []
    for name in members:
        for batch in args.batch:
            rows += bench_member(name, batch, args)
            progress.step(f"{name} b{batch}")
    return rows


main = bench_main(__import__(__name__, fromlist=["NAME"]))

if __name__ == "__main__":
    raise SystemExit(main())
