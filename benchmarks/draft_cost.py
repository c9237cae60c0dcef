"""draft_cost: one draft step / one target decode step, for every drafter kind at real shapes.

    python -m benchmarks.draft_cost [--shapes gemma4-31b gemma4-e4b step3p5] [--layers N] [--batch 1 8] [--quick | --smoke]

Rows (random weights, shapes in benchmarks/shapes.py):
- ``gemma4_mtp``: one Gemma 4 MTP assistant draft step (assistant shape of the target's real assistant,
  ``assistant_shape_source`` says how it is known) = one ``propose`` of k drafts / k;
- ``step3p5_mtp``: one Step 3.5 MTP-layer draft step (block shapes: 96 q heads, 8 kv, d128, sliding) =
  one ``propose`` of k = 3 drafts / 3, beside a target step of a cut-down Step 3.5 (``--step-layers``);
- ``dflash``: one DFlash block forward (block_size - 1 drafts) = one ``propose``, where hf_specdec has a
  DFlash drafter (else the row records why not). No public DFlash config for Gemma 4 31B was at hand: the
  drafter is Qwen3-style at the target's width (5 layers, 32 q / 8 kv heads, d128, block 16), marked
  ``assumed``.
Draft steps are timed by ``TimedDrafter`` (device synchronised around each ``propose``) inside a real
``generate``; the target step is hf_specdec's plain decode step, (t(N) - t(1)) / (forwards(N) - forwards(1)).
``ratio`` = draft step / target step. A cut target (``--layers``) makes the ratio larger than at full depth.
"""

from __future__ import annotations

import statistics

import torch

import hf_specdec
from benchmarks.common import bench_main, decode_rate, free_device_memory
from benchmarks.drafters import TimedDrafter
from benchmarks.shapes import (
    GEMMA4_ASSISTANTS, gemma4_assistant, gemma4_target, random_prompt, shape_name, step3p5_target,
)
from hf_specdec.generation.registry import build_drafter

NAME = "draft_cost"
COLUMNS = ["model_shape", "backend", "batch", "k", "draft_step_ms", "target_step_ms", "ratio", "skipped"]
PRESETS = {
    "smoke": dict(shapes=["smoke-31b", "smoke-step3p5"], batch=[1], prompt=12, new_tokens=6, k=2),
    "quick": dict(layers=12, step_layers=4, prompt=256, new_tokens=16),
}


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", nargs="+", default=["gemma4-31b", "gemma4-e4b", "step3p5"])
    parser.add_argument("--layers", type=int, default=None, help="cut Gemma 4 targets to this many layers")
    parser.add_argument("--step-layers", type=int, default=4,
                        help="main layers of the cut-down Step 3.5 target (layers 0-2 dense, the rest MoE)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=4, help="drafts per Gemma 4 MTP propose")
    parser.add_argument("--no-dflash", action="store_true", help="skip the DFlash rows")


def run(args, progress) -> list[dict]:
    cases = [(shape, batch) for shape in args.shapes for batch in args.batch]
    progress.total(len(cases))
    rows = []
    for shape in args.shapes:
        if "step3p5" in shape:
            target = step3p5_target(shape, args.step_layers, args.device, args.dtype)
            drafters = {"step3p5_mtp": (lambda: build_drafter(target, None, "mtp", 3), 3, "real-block-shapes")}
            layers = args.step_layers
        else:
            target = gemma4_target(shape, args.layers, args.device, args.dtype)
            drafters = _gemma4_drafters(shape, target, args)
            layers = args.layers
        hf_specdec.enable(target)
        for batch in args.batch:
            rows += _batch_rows(target, shape_name(shape, layers), batch, drafters, args)
            progress.step(f"{shape} b{batch}")
        del target, drafters
        free_device_memory()
    return rows


def _gemma4_drafters(shape: str, target, args) -> dict:
    assistant = gemma4_assistant(shape, target, args.device, args.dtype)
    drafters = {"gemma4_mtp": (lambda: build_drafter(target, assistant, "mtp", args.k), args.k,
                               GEMMA4_ASSISTANTS[shape][1])}
    if not args.no_dflash:
        drafters["dflash"] = (lambda: _dflash_drafter(target, args), None, "assumed")
    return drafters


def _dflash_drafter(target, args, k: int | None = None):
    """A random DFlash drafter of an assumed shape for ``target`` (block 16; k = block - 1 unless given)."""
    from hf_specdec.models.dflash import DFlashConfig, DFlashDrafter

    from benchmarks.shapes import build_on_device

    text = target.config.get_text_config()
    small = text.hidden_size < 256
    layers = text.num_hidden_layers
    config = DFlashConfig(
        architectures=["DFlashDraftModel"], hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size, num_hidden_layers=1 if small else 5,
        num_attention_heads=4 if small else 32, num_key_value_heads=2 if small else 8, head_dim=16 if small else 128,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=65536, vocab_size=text.vocab_size,
        tie_word_embeddings=False, num_target_layers=layers, block_size=4 if small else 16,
        dflash_config={"mask_token_id": text.vocab_size - 1,
                       "target_layer_ids": sorted({1, layers // 4, layers // 2, 3 * layers // 4, layers - 2})},
    )
    drafter = build_on_device(DFlashDrafter, config, args.device, args.dtype, seed=2)
    return build_drafter(target, drafter, "dflash", k)


def _batch_rows(target, model_shape: str, batch: int, drafters: dict, args) -> list[dict]:
    ids = random_prompt(batch, args.prompt, target.config.get_text_config().vocab_size, args.device)
    target_step = _target_step_ms(target, ids, args.new_tokens)
    rows = []
    for backend, (make, per_propose, source) in drafters.items():
        row = dict(model_shape=model_shape, backend=backend, batch=batch, k=None, target_step_ms=target_step,
                   assistant_shape_source=source, draft_step_ms=None, ratio=None, tokens_per_s=None, skipped=None)
        try:
            drafter = TimedDrafter(make())
        except Exception as err:  # e.g. no DFlash drafter in this version
            row["skipped"] = f"{type(err).__name__}: {err}"[:300]
            rows.append(row)
            continue
        k = drafter.num_speculative_tokens
        steps_per_propose = per_propose or 1  # DFlash: one block forward per propose
        measured = _propose_seconds(target, ids, args.new_tokens, drafter)
        row.update(k=k, draft_step_ms=1e3 * measured["propose_s"] / steps_per_propose,
                   tokens_per_s=measured["tokens_per_s"], tau=measured["tau"])
        row["ratio"] = row["draft_step_ms"] / target_step
        rows.append(row)
    return rows


def _generate(target, ids, n: int, **extra):
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **extra)


def _target_step_ms(target, ids, new_tokens: int) -> float:
    forwards = lambda _out: hf_specdec.last_generation_stats(target).num_target_forwards  # noqa: E731
    return decode_rate(lambda n: _generate(target, ids, n), ids.shape[0], new_tokens, stats=forwards)["step_ms"]


def _propose_seconds(target, ids, new_tokens: int, drafter: TimedDrafter) -> dict:
    _generate(target, ids, new_tokens, assistant_model=drafter)  # warm-up
    drafter.propose_seconds.clear()
    _generate(target, ids, new_tokens, assistant_model=drafter)
    stats = hf_specdec.last_generation_stats(target)
    return {"propose_s": statistics.median(drafter.propose_seconds), "tokens_per_s": stats.tokens_per_s,
            "tau": stats.mean_accepted_length}


main = bench_main(__import__(__name__, fromlist=["NAME"]))

if __name__ == "__main__":
    raise SystemExit(main())
