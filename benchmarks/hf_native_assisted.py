"""hf_native_assisted: transformers' own assisted decoding vs hf_specdec MTP, identical weights, batch 1.

    python -m benchmarks.hf_native_assisted [--models tiny gemma4-e4b] [--layers N] [--k 4] [--repeats 3]
                                            [--quick | --smoke]

Pairs: the bundled tiny Gemma 4 with its trained MTP assistant (float32), and a random Gemma 4 E4B-shaped
target with a random assistant of the E2B assistant's shape (benchmark dtype; ``--layers`` cuts the target).
Both decoders read the same assistant weights: hf_specdec loads ``Gemma4MTPAssistant`` and transformers
loads its own ``Gemma4AssistantForCausalLM`` from the same checkpoint folder. Rows: ``hf_dynamic`` (plain
``generate``, the token reference), ``hf_native_assisted`` (``generate(assistant_model=...,
num_assistant_tokens=k)`` on the stock model; where this transformers version cannot build or run it the
row records why in ``skipped``) and ``hf_specdec_mtp``. Greedy; tokens are compared with ``hf_dynamic``.
tokens/s is steady state, prefill excluded: (N-1) / (t(N) - t(1)), the median of ``--repeats`` timed pairs (one
pair of 32 tokens once read 3990 tok/s for a row that reads ~1300 in e2e_tiny: a slow t(1) inflates it).
"""

from __future__ import annotations


import torch

import hf_specdec
from benchmarks.common import add_pair_arguments, bench_main, decode_rate, first_mismatch, rows_per_model
from benchmarks.shapes import gemma4_assistant, gemma4_target, random_prompt, shape_name

NAME = "hf_native_assisted"
COLUMNS = ["model_shape", "backend", "batch", "k", "tokens_per_s", "tau", "speedup_vs_native", "same_tokens",
           "skipped"]
PRESETS = {
    "smoke": dict(models=["tiny", "smoke-e4b"], prompt=12, new_tokens=8, repeats=1),
    "quick": dict(layers=12, prompt=128, new_tokens=32),
}


def add_arguments(parser) -> None:
    parser.add_argument("--models", nargs="+", default=["tiny", "gemma4-e4b"],
                        help="'tiny' (the bundled family) and/or a Gemma 4 shape of benchmarks/shapes.py")
    parser.add_argument("--k", type=int, default=4)
    add_pair_arguments(parser, "prompt tokens of the random pair", "cut the random target to this many layers")


def run(args, progress) -> list[dict]:
    return rows_per_model(args, progress, _model_rows)


def _model_rows(name: str, folder: str, args) -> list[dict]:
    return _rows(*_pair(name, folder, args), args)  # the pair is freed on return


def _pair(name: str, folder: str, args):
    """(stock target, assistant checkpoint folder, prompt ids [1, len], model_shape)."""
    if name == "tiny":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from hf_specdec.assets import asset_path, held_out_snippets

        target = AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))
        ids = tokenizer([held_out_snippets()[0]["text"][:200]], return_tensors="pt")["input_ids"]
        target.generation_config.eos_token_id = None  # every decoder runs the full length
        return target.to(args.device).eval(), str(asset_path("tiny-gemma4-assistant")), ids.to(args.device), "tiny-gemma4"
    target = gemma4_target(name, args.layers, args.device, args.dtype)
    gemma4_assistant(name, target, args.device, args.dtype).save_pretrained(folder)
    ids = random_prompt(1, args.prompt, target.config.vocab_size, args.device)
    return target, folder, ids, shape_name(name, args.layers)


def _rows(target, assistant_dir: str, ids, model_shape: str, args) -> list[dict]:
    common = dict(model_shape=model_shape, batch=1, prompt=ids.shape[1], new_tokens=args.new_tokens)
    plain = _speed(target, ids, args, {})
    reference = plain["output"]
    rows = [dict(common, backend="hf_dynamic", k=None, tokens_per_s=plain["tokens_per_s"], tau=1.0, same_tokens=True)]
    native = dict(common, backend="hf_native_assisted", k=args.k, tokens_per_s=None, same_tokens=None, skipped=None)
    try:
        assistant = _hf_assistant(assistant_dir, target)
        measured = _speed(target, ids, args, dict(assistant_model=assistant, num_assistant_tokens=args.k))
        native.update(tokens_per_s=measured["tokens_per_s"], **_compare(reference, measured["output"]))
    except Exception as err:  # the stock path failing on this version is the result
        native["skipped"] = f"{type(err).__name__}: {err}"[:300]
    rows.append(native)
    hf_specdec.enable(target)
    try:
        assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=target.dtype).to(target.device)
        measured = _speed(target, ids, args, dict(assistant_model=assistant, num_speculative_tokens=args.k))
        ours = dict(common, backend="hf_specdec_mtp", k=args.k, tokens_per_s=measured["tokens_per_s"],
                    tau=hf_specdec.last_generation_stats(target).mean_accepted_length,
                    **_compare(reference, measured["output"]))
    finally:
        hf_specdec.disable(target)
    if native["tokens_per_s"]:
        ours["speedup_vs_native"] = ours["tokens_per_s"] / native["tokens_per_s"]
    rows.append(ours)
    return rows


def _hf_assistant(folder: str, target):
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

    return Gemma4AssistantForCausalLM.from_pretrained(folder, dtype=target.dtype).to(target.device).eval()


def _speed(target, ids, args, extra: dict) -> dict:
    def generate(n):
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **extra)

    return decode_rate(generate, 1, args.new_tokens, repeats=args.repeats)


def _compare(reference, output) -> dict:
    mismatch = first_mismatch(reference, output)
    return {"same_tokens": mismatch is None, **({"first_mismatch": mismatch} if mismatch else {})}


main = bench_main(__import__(__name__, fromlist=["NAME"]))

if __name__ == "__main__":
    raise SystemExit(main())
