"""e2e_synthetic: end-to-end Gemma 4 MTP and DFlash decoding at a fixed acceptance rate, beside plain decoding.

    python -m benchmarks.e2e_synthetic [--shape gemma4-31b | gemma4-26b-a4b | step3p5] [--layers N] [--alpha 0.6 0.8] [--k 3 7] [--batch 1 32]
        [--drafter mtp dflash] [--weights bf16 | fp8 | nf4 | int4] [--quick | --smoke]

Random weights accept almost no drafts, so the speculative rows run a real drafter — the Gemma 4 MTP
assistant, and a DFlash drafter of an assumed shape (``--drafter``) — with its real draft cost, but accept
each draft with probability alpha (``SyntheticAcceptance``, benchmarks/drafters.py, passed as
``generate(acceptance=...)``): the committed tokens are not the target's greedy tokens, and these rows say ``lossless: false``. This measures system
throughput at a given tau (expected tau = sum_{i<=k} alpha^i), as vLLM's synthetic acceptance mode does.
Beside them: ``hf_dynamic`` (transformers ``generate``) and ``hf_specdec`` plain on the same shape.
tokens/s is steady state, prefill excluded: batch*(N-1) / (t(N) - t(1)). ``vs_floor_tau`` =
tokens/s / (tau * floor tokens/s), the fraction of the ideal "tau tokens per bandwidth-bound step".
With ``--seeds`` each of the ``--repeats`` timed calls draws its acceptances from a seed of its own, the same seeds for
every row (records: ``acceptance_seeds``), so that rows that differ in k (or "auto") are compared over several
draws: at batch 1 and 128 new tokens one draw's tau moves by ~10% around its expected value. Such a row's rate is
then the pooled one (all its timed calls' tokens over their summed times) and its tau their tokens over their target
forwards (the harmonic mean of the calls' taus); rows without draws (plain decoding) keep the median.
``--k auto`` rows get five warm-up calls instead of one: the controller times its rounds there (a new k also
captures its graphs, 50-300 ms each on a 12-layer 31B cut), and on the GPU, where no k gains much, plain decoding in
one call, as a user's first calls of a model at a batch size would; later calls start from those timings and that
acceptance.

``--weights fp8`` (``nf4``, ``int4``) quantizes the target first (benchmarks/shapes.py); the drafters stay in the
bench dtype (a bf16 assistant beside an FP8 target, as it is loaded in practice) and the floors count the stored
bytes. The transformers row runs its own FP8 layers (W8A8, a GPU kernel); where they do not run, the row says why.
"""

from __future__ import annotations

import statistics

import torch

import hf_specdec
from benchmarks.common import (AUTO_WARMUPS, bench_main, copy_bandwidth_gb_s, decode_rate, free_device_memory,
                               k_value)
from benchmarks.draft_cost import _dflash_drafter
from benchmarks.drafters import SyntheticAcceptance, expected_tau
from benchmarks.shapes import (
    STEP3P5,
    WEIGHTS,
    floor_tokens_per_s,
    gemma4_assistant,
    random_prompt,
    shape_name,
    target_for,
)
from hf_specdec.generation.registry import build_drafter

NAME = "e2e_synthetic"
COLUMNS = ["model_shape", "weights", "backend", "batch", "k", "alpha", "tau", "expected_tau", "tokens_per_s",
           "speedup_vs_plain", "vs_floor_tau", "lossless", "skipped"]
PRESETS = {
    "smoke": dict(shape="smoke-31b", batch=[1, 4], prompt=12, new_tokens=8, k=[3, "auto"]),
    # 128 new tokens: at batch 32 every row accepts at its own pace and the call lasts until the slowest row
    # is done; with 32 tokens that ragged end, not the steady state, set the speed (1.01x vs 1.40x plain at k=3)
    "quick": dict(layers=12, prompt=256, new_tokens=128, k=[3, 7]),
}


def add_arguments(parser) -> None:
    parser.add_argument("--shape", default="gemma4-31b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.6, 0.8])
    parser.add_argument("--k", type=k_value, nargs="+", default=[7],
                        help="drafts per step; several values give one row each (a large batch may want fewer); "
                             f"\"auto\": chosen per round, up to {AUTO_K_MAX} (DFlash: up to its block size - 1)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1,
                        help="time each row this many times and keep the median (the full-depth rows vary by a "
                             "few percent between runs; with --seeds, the rows that draw acceptances pool them)")
    parser.add_argument("--seeds", action="store_true",
                        help="each of the --repeats draws its synthetic acceptances from a seed of its own (0, 1, "
                             "...), the same for every row, and the rows' rates pool them: a rate over several "
                             "draws, not one draw's luck (at batch 1 and 128 tokens one draw's tau moves by ~10%%)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the transformers generate rows")
    parser.add_argument("--drafter", nargs="+", choices=["mtp", "dflash"], default=["mtp", "dflash"],
                        help="drafters to run: the Gemma 4 MTP assistant and/or a DFlash drafter (assumed shape, "
                             "as in draft_cost)")
    parser.add_argument("--weights", choices=WEIGHTS, default="bf16",
                        help="the target's weights: dense in the bench dtype, quantized to FP8 (128 x 128 blocks), or "
                             "to 4 bits (bitsandbytes NF4, torchao int4); drafters stay dense")


AUTO_K_MAX = 7  # the most drafts a round of an "auto" row may have (Step 3.5: its MTP layers)


def run(args, progress) -> list[dict]:
    if args.seeds and args.repeats < 2:
        raise SystemExit(f"{NAME}: --seeds draws each repeat's acceptances from a seed of its own: give --repeats 2 or "
                         f"more (got {args.repeats})")
    bandwidth = copy_bandwidth_gb_s(args.device)
    target = target_for(args.shape, args.layers, args.device, args.dtype, args.weights)
    # a Step 3.5 target drafts with its own MTP layers (spec_mode="mtp", k <= 3); Gemma 4 with its assistant
    assistant = None if args.shape in STEP3P5 else gemma4_assistant(args.shape, target, args.device, args.dtype)
    model_shape = shape_name(args.shape, args.layers)
    progress.total(len(args.batch) * (len(args.alpha) * len(args.drafter) * len(args.k) + 2))
    rows = []
    for batch in args.batch:
        ids = random_prompt(batch, args.prompt, target.config.vocab_size, args.device)
        context = args.prompt + args.new_tokens // 2
        floor = floor_tokens_per_s(target, batch, context, bandwidth)["floor_tokens_per_s"]
        common = dict(model_shape=model_shape, weights=args.weights, batch=batch, prompt=args.prompt,
                      new_tokens=args.new_tokens, floor_tokens_per_s=floor, repeats=args.repeats,
                      acceptance_seeds=args.repeats if args.seeds else None)
        batch_rows = []
        if not args.skip_hf:
            batch_rows.append(dict(common, backend="hf_dynamic", k=None, alpha=None, lossless=True,
                                   **_transformers_speed(target, ids, args)))
            progress.step(f"b{batch} hf_dynamic")
        hf_specdec.enable(target)
        batch_rows.append(dict(common, backend="hf_specdec", k=None, alpha=None, lossless=True,
                               **_speed(target, ids, args, {})))
        progress.step(f"b{batch} hf_specdec")
        for kind in args.drafter:
            for k in args.k:
                for alpha in args.alpha:
                    # "auto": up to AUTO_K_MAX drafts (Step 3.5: its MTP layers; DFlash: its block's default)
                    most = (k if k != "auto" else None if kind == "dflash" else
                            min(AUTO_K_MAX, target.num_mtp_layers) if args.shape in STEP3P5 else AUTO_K_MAX)
                    inner = (build_drafter(target, assistant, "mtp", most) if kind == "mtp"
                             else _dflash_drafter(target, args, most))
                    most = inner.num_speculative_tokens
                    synthetic = dict(assistant_model=inner, acceptance=SyntheticAcceptance(alpha),
                                     num_speculative_tokens=k if k == "auto" else None)
                    # the bytes a verify step of k+1 tokens per row reads (an MoE target: the union of the
                    # experts its tokens select), so vs_verify_floor_tau is reachable where vs_floor_tau is not
                    verify_floor = floor_tokens_per_s(target, batch, context, bandwidth, tokens_per_row=most + 1)
                    batch_rows.append(dict(common, backend=f"hf_specdec_{kind}_synthetic", k=k, alpha=alpha,
                                           lossless=False,
                                           expected_tau=None if k == "auto" else expected_tau(alpha, k),
                                           verify_floor_tokens_per_s=verify_floor["floor_tokens_per_s"],
                                           **_speed(target, ids, args, synthetic)))
                    progress.step(f"b{batch} {kind} k {k} alpha {alpha}")
        hf_specdec.disable(target)
        plain = next(r["tokens_per_s"] for r in batch_rows if r["backend"] == "hf_specdec")
        for r in batch_rows:
            if r["tokens_per_s"] is None:
                continue
            r["speedup_vs_plain"] = r["tokens_per_s"] / plain
            r["vs_floor_tau"] = r["tokens_per_s"] / (r["tau"] * floor)
            if "verify_floor_tokens_per_s" in r:
                r["vs_verify_floor_tau"] = r["tokens_per_s"] / (r["tau"] * r["verify_floor_tokens_per_s"])
        rows += batch_rows
    del target, assistant
    free_device_memory()
    return rows


def _transformers_speed(target, ids, args) -> dict:
    """transformers' own generate on the target; with FP8 weights its FP8 layers need their GPU kernel, and a row
    that cannot run says why."""
    try:
        return dict(_speed(target, ids, args, {}), skipped=None)
    except Exception as err:  # a baseline that does not run on this version/device is a result too
        if args.weights == "bf16":
            raise
        return dict(tokens_per_s=None, tau=None, skipped=f"{type(err).__name__}: {err}"[:300])


def _speed(target, ids, args, extra: dict) -> dict:
    enabled = getattr(target, "_hf_specdec", None) is not None

    acceptance = extra.get("acceptance")
    pooled = args.seeds and acceptance is not None  # --seeds: the rows that draw acceptances pool their draws

    def generate(n):
        if acceptance is not None:
            acceptance.restart()  # every call (and every k) draws the same acceptances
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               do_sample=False, **extra)

    def reseed(pair):  # --seeds: the i-th timed pair of every row on seed i (the warm-ups on the first pair's)
        acceptance.restart(seed=pair)

    stats = (lambda _out: hf_specdec.last_generation_stats(target).num_target_forwards) if enabled else None
    tau_of_call = (lambda: hf_specdec.last_generation_stats(target).mean_accepted_length) if enabled else None
    measured = decode_rate(generate, ids.shape[0], args.new_tokens, stats=stats, repeats=args.repeats,
                           snapshot=tau_of_call,
                           warmups=AUTO_WARMUPS if extra.get("num_speculative_tokens") == "auto" else 1,
                           before_pair=reseed if pooled else None, pooled=pooled)
    tau = 1.0
    if enabled:  # pooled: over the draws as the rate pools them (each call's tokens alike: the harmonic mean)
        tau = statistics.harmonic_mean(measured["snapshots"]) if pooled else measured["snapshot"]
    return {"tokens_per_s": measured["tokens_per_s"], "tau": tau}


main = bench_main(__import__(__name__, fromlist=["NAME"]))

if __name__ == "__main__":
    raise SystemExit(main())
