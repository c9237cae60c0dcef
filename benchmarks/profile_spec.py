"""Where a speculative step's time goes, end to end: one ``generate`` call of the e2e_synthetic setup
(Gemma-4-31B shape cut to ``--layers``, the MTP assistant, synthetic acceptance alpha) timed per phase
(draft, verify forward, scoring and acceptance, the host sync, bookkeeping; the device is synchronised
at every boundary, so the phases add up to more than an unsynchronised step), then the device kernels
(torch.profiler). With ``--bundled`` it profiles a drafter of the bundled tiny family instead, with its real
acceptance: there the steps are bound by host work, so the table lists the ops by host time.

    PYTHONPATH=. python -m benchmarks.profile_spec [--batch 32] [--k 7] [--alpha 0.8] [--layers 12]
    PYTHONPATH=. python -m benchmarks.profile_spec --bundled dflash|mtp|step3p5 [--batch 1] [--k 3]

``--host-rounds CALLS`` adds the host's work inside the loop's rounds alone, per round (cProfile around
``SpeculativeLoop.step``): on small targets a round's pace is the host's, and this says where it goes.
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack
from unittest import mock

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="gemma4-31b")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=None,
                        help="drafts a round (default 7; --bundled step3p5: its checkpoint's MTP layers)")
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument("--rows", type=int, default=22)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (--shape smoke-31b)")
    parser.add_argument("--bundled", choices=["mtp", "dflash", "step3p5"], default=None,
                        help="profile this drafter of the bundled tiny family (real acceptance) instead")
    parser.add_argument("--host-rounds", type=int, default=0, metavar="CALLS",
                        help="also profile the host's work inside the loop's rounds only (cProfile around "
                             "SpeculativeLoop.step, prefill and call setup left out) over this many calls")
    args = parser.parse_args(argv)
    if args.k is None and args.bundled != "step3p5":
        args.k = 7
    import hf_specdec

    target, ids, extra, inner = (_bundled if args.bundled else _synthetic)(args)

    def generate(n=args.new_tokens):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, **extra)
        _sync()
        return out

    def plain(n=args.new_tokens):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              eos_token_id=None)
        _sync()
        return out

    for fn in (generate, plain):
        fn(), fn()
    start = time.perf_counter()
    plain()
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    generate()
    spec_s = time.perf_counter() - start
    stats = hf_specdec.last_generation_stats(target)
    steps = stats.num_target_forwards - 1
    acceptance = f"{args.bundled} (bundled)" if args.bundled else f"alpha {args.alpha}"
    print(f"batch {args.batch}, k {args.k}, {acceptance}: tau {stats.mean_accepted_length:.2f}, "
          f"{steps} spec steps, {spec_s * 1e3:.1f} ms/call, {spec_s * 1e3 / steps:.2f} ms/step incl. prefill "
          f"(plain: {plain_s * 1e3:.1f} ms/call, {plain_s * 1e3 / args.new_tokens:.2f} ms/step)")

    phases = _phase_times(generate, type(inner))
    steps = hf_specdec.last_generation_stats(target).num_target_forwards - 1
    print(f"phase (device synced at each boundary; {steps} spec steps)   ms per spec step")
    for name, seconds, calls in phases:
        print(f"  {name:40s} {seconds * 1e3 / steps:8.2f}   ({calls} calls)")

    if args.host_rounds:
        print("\n".join(_host_rounds(generate, args.host_rounds, args.rows)))

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])) as prof:
        generate()
    print("kernels of one call (prefill included):")
    by_device = args.device == "cuda" and not args.bundled
    print(prof.key_averages().table(sort_by="self_cuda_time_total" if by_device else "cpu_time_total",
                                    row_limit=args.rows, max_name_column_width=50))
    return 0


def _synthetic(args):
    """(target, ids, generate kwargs, drafter): the Gemma 4 shape with its MTP assistant, synthetic acceptance."""
    import hf_specdec
    from benchmarks.drafters import SyntheticAcceptance
    from benchmarks.shapes import gemma4_assistant, gemma4_target, random_prompt
    from hf_specdec.generation.registry import build_drafter

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = gemma4_target(args.shape, args.layers, args.device, dtype)
    assistant = gemma4_assistant(args.shape, target, args.device, dtype)
    ids = random_prompt(args.batch, args.prompt, target.config.vocab_size, args.device)
    inner = build_drafter(hf_specdec.enable(target), assistant, "mtp", args.k)
    return target, ids, dict(assistant_model=inner, acceptance=SyntheticAcceptance(args.alpha)), inner


def _bundled(args):
    """(target, ids, generate kwargs, drafter) of the bundled tiny family in bf16 (fp32 on the CPU): batch rows of
    the same code prompt, truncated to --prompt tokens."""
    from transformers import AutoTokenizer

    from hf_specdec import AutoModelForCausalLM
    from hf_specdec.assets import asset_path
    from hf_specdec.generation.registry import build_drafter

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    name = "tiny-step3p5" if args.bundled == "step3p5" else "tiny-gemma4"
    target = AutoModelForCausalLM.from_pretrained(asset_path(name), dtype=dtype).to(args.device)  # enabled
    text = "import os\n\n\ndef walk(root):\n    for name in sorted(os.listdir(root)):\n"
    ids = AutoTokenizer.from_pretrained(asset_path(name))([text] * args.batch, return_tensors="pt").input_ids
    ids = ids[:, -args.prompt:].to(args.device)
    if args.bundled == "step3p5":
        if args.k is None:
            args.k = target.num_mtp_layers  # one draft per MTP layer at most
        extra = dict(spec_mode="mtp", num_speculative_tokens=args.k)
    else:
        path = asset_path("tiny-gemma4-assistant" if args.bundled == "mtp" else "tiny-gemma4-dflash")
        assistant = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device)
        extra = dict(assistant_model=assistant, num_speculative_tokens=args.k)
    inner = build_drafter(target, extra.get("assistant_model"), extra.get("spec_mode"), args.k)
    return target, ids, extra, inner



def _host_rounds(generate, calls: int, rows: int) -> list[str]:
    """The host's work inside the loop's rounds (``SpeculativeLoop.step``; the prefill and each call's setup left out):
    the wall time of a round, unprofiled (the host's wait for a read-back included), over ``calls`` calls, then its
    Python functions under cProfile over as many calls, per round: where a round is bound by the host (small
    targets), what it spends its time on."""
    import cProfile
    import io
    import pstats

    from hf_specdec.generation import speculative as loop

    step = loop.SpeculativeLoop.step
    seconds: list[float] = []
    profiler, profiled_rounds = cProfile.Profile(), [0]

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return step(self, *args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    def profiled(self, *args, **kwargs):
        profiled_rounds[0] += 1
        profiler.enable()
        try:
            return step(self, *args, **kwargs)
        finally:
            profiler.disable()

    for wrapper in (timed, profiled):
        with mock.patch.object(loop.SpeculativeLoop, "step", wrapper):
            for _ in range(calls):
                generate()
    if not seconds or not profiled_rounds[0]:
        return ["host work of the rounds: the calls ran no round (one new token each?)"]
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    rounds = profiled_rounds[0]
    head = (f"host work of the rounds: {1e6 * sum(seconds) / len(seconds):.0f} us a round unprofiled ({len(seconds)} "
            f"rounds in {calls} calls); under cProfile {stats.total_calls / rounds:.0f} Python calls and "
            f"{1e6 * stats.total_tt / rounds:.0f} us a round")
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return [head] + out.getvalue().splitlines()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _phase_times(generate, drafter_type) -> list[tuple[str, float, int]]:
    """Run ``generate`` once with the loop's phases wrapped in device syncs and timers."""
    from benchmarks.drafters import SyntheticAcceptance
    from hf_specdec.cache import PagedKVCache
    from hf_specdec.generation import speculative as loop
    from hf_specdec.generation.acceptance import GreedyAcceptance
    from hf_specdec.runtime import ModelRunner
    from hf_specdec.generation.sampling import PositionScorer

    durations: dict[str, list[float]] = {}

    def timed_call(name, fn):
        def wrapper(*args, **kwargs):
            _sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync()
            durations.setdefault(name, []).append(time.perf_counter() - start)
            return out
        return wrapper

    targets = [
        ("draft: propose (k steps)", drafter_type, "propose"),
        ("draft: ahead (k steps, queued before the sync)", drafter_type, "propose_ahead"),
        ("drafter commit", drafter_type, "commit"),
        ("target forward (verify)", ModelRunner, "forward"),
        ("  cache plans (host; every cache, drafters' too)", PagedKVCache, "plan_forward"),
        ("cache commit / rollback", ModelRunner, "commit"),
        ("scorer (logits processors)", PositionScorer, "score"),
        ("acceptance (synthetic)", SyntheticAcceptance, "__call__"),
        ("acceptance (greedy)", GreedyAcceptance, "__call__"),
        ("emit (stop checks, streamer)", loop.SpeculativeLoop, "_emit"),
        ("row ids to device", loop.RowIds, "extend"),
    ]
    with ExitStack() as stack:
        for name, owner, attr in targets:
            if not hasattr(owner, attr):  # e.g. a drafter without propose_ahead
                continue
            stack.enter_context(mock.patch.object(owner, attr, timed_call(name, getattr(owner, attr))))
        _sync()
        start = time.perf_counter()
        generate()
        total = time.perf_counter() - start
    prefill = durations["target forward (verify)"].pop(0)  # the first forward of a call is the prompt's
    durations.get("  cache plans (host; every cache, drafters' too)", [0.0]).pop(0)  # the prompt's plan
    rows = [(name, sum(durations.get(name, [])), len(durations.get(name, []))) for name, _, _ in targets]
    counted = prefill + sum(seconds for name, seconds, _ in rows if not name.startswith(" "))
    return rows + [("rest (logits to float, host sync, loop)", total - counted, 1), ("total (synced, no prefill)",
                                                                                      total - prefill, 1)]


if __name__ == "__main__":
    raise SystemExit(main())
