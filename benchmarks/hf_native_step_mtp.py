"""hf_native_step_mtp: transformers' Step 3.7 with its own MTP vs hf_specdec's Step 3.5, same weights, batch 1.

    python -m benchmarks.hf_native_step_mtp [--models tiny step3p5] [--layers N] [--k 3] [--repeats 3]
                                            [--quick | --smoke]

Models: the bundled tiny Step 3.5 (float32, trained MTP layers) and a random Step 3.5-shaped model
(benchmarks/shapes.py, benchmark dtype; ``--layers`` cuts the main layers, the 3 MTP layers stay). hf_specdec's
``Step3p5ForCausalLM`` is built first and written as a transformers Step 3.7 checkpoint
(hf_specdec/models/step3p5/step3p7.py: the key mapping, one shard per layer); after its rows it is freed and
transformers loads ``Step3p7ForConditionalGeneration`` from that folder, so one model is resident at a time
(the folder, under TMPDIR, holds the weights once more: ~33 GB for step3p5/L6, each MoE layer ~9.3 GB in bf16).
The random model's MTP layers share ``lm_head`` as their head, since transformers' MTP drafts with ``lm_head``;
the tiny model keeps its trained MTP heads, which transformers does not read, so its drafts differ from
hf_specdec's (lossless either way). Random weights accept next to no drafts: their rows measure what a round
costs each stack, the tiny rows real acceptance. transformers' routers are put back in fp32 after loading, as
Step 3.5 runs them (``need_fp32_gate``) and hf_specdec keeps them: otherwise the two stacks compute different
functions in bf16.

Rows: ``hf_dynamic`` (transformers' Step 3.7 ``generate``, the token reference), ``hf_native_mtp``
(``generate(use_mtp=True)``, all MTP layers), ``hf_specdec`` (``hf_specdec.enable``, plain) and
``hf_specdec_mtp`` (``generate(spec_mode="mtp", num_speculative_tokens=k)``). Greedy, one prompt. Where the
installed transformers has no Step 3.7, no MTP in ``generate``, or its run fails, the row records why in
``skipped`` (the reference is then ``Step3p5ForCausalLM`` under transformers' own ``generate``). tokens/s is
steady state, prefill excluded: (N-1) / (t(N) - t(1)), the median of ``--repeats`` timed pairs; transformers
reads the MTP weights from the folder in every ``use_mtp`` call, a cost the difference cancels. tau: new tokens
per target forward, the prefill counted as one forward. ``speedup_vs_plain``: over the same stack's plain row;
``speedup_vs_hf_dynamic``: over transformers' plain row. A token mismatch is reported with the reference's top-2
logit gap there (``near_tie`` when within 2 bf16 ulps, docs/architecture.md, "Exactness").
"""

from __future__ import annotations


import torch
import transformers

import hf_specdec
from benchmarks.common import (
    add_pair_arguments,
    bench_main,
    decode_rate,
    first_mismatch,
    free_device_memory,
    rows_per_model,
)
from benchmarks.decode import _near_tie
from benchmarks.shapes import random_prompt, shape_name, step3p5_target
from hf_specdec.models.step3p5 import step3p7

NAME = "hf_native_step_mtp"
COLUMNS = ["model_shape", "backend", "k", "tokens_per_s", "tau", "speedup_vs_plain", "speedup_vs_hf_dynamic",
           "same_tokens", "skipped"]
PRESETS = {
    "smoke": dict(models=["tiny", "smoke-step3p5"], prompt=12, new_tokens=8, repeats=1),
    "quick": dict(layers=4, prompt=128, new_tokens=32),
}
PLAIN_OF = {"hf_dynamic": "hf_dynamic", "hf_native_mtp": "hf_dynamic", "hf_specdec": "hf_specdec",
            "hf_specdec_mtp": "hf_specdec"}


def add_arguments(parser) -> None:
    parser.add_argument("--models", nargs="+", default=["tiny", "step3p5"],
                        help="'tiny' (the bundled tiny-step3p5) and/or a Step 3.5 shape of benchmarks/shapes.py")
    parser.add_argument("--k", type=int, default=3, help="hf_specdec's num_speculative_tokens (transformers: all "
                                                         "MTP layers)")
    add_pair_arguments(parser, "prompt tokens of the random model", "cut the random model to this many main layers")


def run(args, progress) -> list[dict]:
    return rows_per_model(args, progress, _model_rows)


def _model_rows(name: str, folder: str, args) -> list[dict]:
    """1. build hf_specdec's model and write it as a Step 3.7 checkpoint; 2. time it; 3. free it, load
    transformers' model from the folder and time that; 4. compare every output with the reference."""
    model, ids, model_shape = _step3p5_model(name, args)
    missing = _native_missing()
    reference = _reference(model, ids, args) if missing else None
    if not missing:
        step3p7.save_as_step3p7(model, folder)
    measured = _measure_hf_specdec(model, ids, args)
    dtype = model.dtype
    del model
    free_device_memory()
    if missing:
        measured |= {"hf_dynamic": missing, "hf_native_mtp": missing}
    else:
        native, reference = _measure_native(folder, ids, dtype, args)
        measured |= native
    common = dict(model_shape=model_shape, batch=1, prompt=ids.shape[1], new_tokens=args.new_tokens,
                  reference="Step3p5ForCausalLM, transformers generate" if missing else "hf_dynamic")
    return _rows(common, measured, reference)


def _step3p5_model(name: str, args):
    """(hf_specdec's Step3p5ForCausalLM, prompt ids [1, len], model_shape)."""
    if name == "tiny":
        from hf_specdec.assets import asset_path, held_out_snippets

        model = transformers.AutoModelForCausalLM.from_pretrained(asset_path("tiny-step3p5"), dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(asset_path("tiny-step3p5"))
        ids = tokenizer([held_out_snippets()[0]["text"][:200]], return_tensors="pt")["input_ids"]
        model.generation_config.eos_token_id = None  # every decoder runs the full length
        return model.to(args.device).eval(), ids.to(args.device), "tiny-step3p5"
    model = step3p5_target(name, args.layers, args.device, args.dtype)
    for layer in model.model.mtp_layers:
        layer.shared_head.head.weight = model.lm_head.weight
    return model, random_prompt(1, args.prompt, model.config.vocab_size, args.device), shape_name(name, args.layers)


def _native_missing() -> str | None:
    """Why transformers' Step 3.7 MTP cannot be measured here, or None."""
    if not step3p7.is_available():
        return f"transformers {transformers.__version__} has no Step 3.7 (transformers.models.step3p7)"
    if not hasattr(transformers.GenerationConfig(), "use_mtp"):
        return f"transformers {transformers.__version__}: generate has no use_mtp"
    return None


def _measure_hf_specdec(model, ids, args) -> dict:
    hf_specdec.enable(model)
    try:
        plain = _speed(model.generate, ids, args, {})
        spec = _speed(model.generate, ids, args, dict(spec_mode="mtp", num_speculative_tokens=args.k))
        spec |= dict(k=args.k, tau=hf_specdec.last_generation_stats(model).mean_accepted_length)
    finally:
        hf_specdec.disable(model)
    return {"hf_specdec": plain, "hf_specdec_mtp": spec}


def _measure_native(folder: str, ids, dtype: torch.dtype, args) -> tuple[dict, tuple]:
    """({backend: measurement or skipped reason}, reference) of transformers' Step 3.7 loaded from ``folder``."""
    from transformers import Step3p7ForConditionalGeneration

    model = Step3p7ForConditionalGeneration.from_pretrained(folder, dtype=dtype, device_map={"": args.device}).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    _fp32_routers(model)
    forwards = []
    hook = model.model.language_model.register_forward_hook(lambda *_: forwards.append(1))

    def generate(*a, **kw):
        forwards.clear()
        return model.generate(*a, **kw)

    try:
        measured = {"hf_dynamic": _speed(generate, ids, args, {})}
        reference = _reference(model, ids, args)
        try:
            native = _speed(generate, ids, args, dict(use_mtp=True))
            num_mtp = model.config.get_text_config().num_nextn_predict_layers
            measured["hf_native_mtp"] = native | dict(k=num_mtp, tau=args.new_tokens / max(len(forwards), 1))
        except Exception as err:  # the stock path failing on this version is the result
            measured["hf_native_mtp"] = f"{type(err).__name__}: {err}"[:300]
    finally:
        hook.remove()
    del model
    free_device_memory()
    return measured, reference


def _fp32_routers(model) -> None:
    """Routers (weight and score-correction bias) of a loaded transformers Step 3.7 model back in fp32."""
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TopKRouter

    for module in model.modules():
        if isinstance(module, Step3p7TopKRouter):
            module.float()


def _speed(generate, ids, args, extra: dict) -> dict:
    def run(n):
        return generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **extra)

    return decode_rate(run, 1, args.new_tokens, repeats=args.repeats)


def _reference(model, ids, args) -> tuple:
    """(sequences [1, len], logits per new token) of one untimed greedy ``generate``."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences, out.logits


def _rows(common: dict, measured: dict, reference: tuple) -> list[dict]:
    """One row per backend, in PLAIN_OF's order; a str measurement is a skipped reason."""
    speeds = {b: m["tokens_per_s"] for b, m in measured.items() if isinstance(m, dict)}
    rows = []
    for backend, plain in PLAIN_OF.items():
        m = measured[backend]
        row = dict(common, backend=backend, k=None, tokens_per_s=None, tau=None, same_tokens=None, skipped=None)
        if isinstance(m, str):
            rows.append(row | dict(skipped=m))
            continue
        row.update(k=m.get("k"), tokens_per_s=m["tokens_per_s"], tau=m.get("tau", 1.0), **_compare(reference, m))
        row["speedup_vs_plain"] = m["tokens_per_s"] / speeds[plain] if plain in speeds else None
        row["speedup_vs_hf_dynamic"] = m["tokens_per_s"] / speeds["hf_dynamic"] if "hf_dynamic" in speeds else None
        rows.append(row)
    return rows


def _compare(reference: tuple, measured: dict) -> dict:
    sequences, logits = reference
    mismatch = first_mismatch(sequences, measured["output"], logits)
    if mismatch is None:
        return {"same_tokens": True}
    near_tie = _near_tie(logits, mismatch, sequences.shape[1])
    return {"same_tokens": False, "first_mismatch": mismatch, "near_tie": near_tie}


main = bench_main(__import__(__name__, fromlist=["NAME"]))

if __name__ == "__main__":
    raise SystemExit(main())
