"""End to end on the bundled tiny family: plain vs each speculative mode, real tau and speed-up.

    PYTHONPATH=. python benchmarks/e2e_tiny.py [--batch 1 4] [--new-tokens 128] [--device cuda|cpu]

Prompts are the bundled held-out snippets (code no member was trained on). Rows: transformers
`generate` (hf_dynamic), hf_specdec plain, and every bundled drafter (Gemma 4 MTP assistant at several
k, DFlash, Step 3.5 MTP-k). Greedy; every hf_specdec row is checked token for token against
transformers. Prints a table, appends records to benchmarks/results/e2e_tiny.jsonl, and prints one JSON
line last.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from benchmarks.common import append_records, environment, print_table, timed
from hf_specdec.assets import asset_path, available_assets, held_out_snippets


def _prompts(tokenizer, batch: int, device):
    texts = [s["text"][:200] for s in held_out_snippets()]
    texts = (texts * batch)[:batch]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True).to(device)


def _runs(model_name: str):
    """(backend name, k, generate kwargs) of each speculative configuration for a family member."""
    if model_name == "tiny-gemma4":
        if "tiny-gemma4-assistant" in available_assets():
            assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-assistant"))
            for k in (2, 4, 7):
                yield "hf_specdec_mtp", k, dict(assistant_model=assistant, num_speculative_tokens=k)
        if "tiny-gemma4-dflash" in available_assets():
            drafter = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-dflash"))
            yield "hf_specdec_dflash", None, dict(assistant_model=drafter)
    elif model_name == "tiny-step3p5":
        for k in (1, 2, 3):
            yield "hf_specdec_mtp", k, dict(spec_mode="mtp", num_speculative_tokens=k)


def bench_member(name: str, batch: int, new_tokens: int, device) -> list[dict]:
    model = AutoModelForCausalLM.from_pretrained(asset_path(name), dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))
    inputs = _prompts(tokenizer, batch, device)
    kwargs = dict(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.generate(**{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
    reference, seconds = timed(lambda: model.generate(**kwargs))
    base = batch * new_tokens / seconds
    rows = [dict(model_shape=name, backend="hf_dynamic", batch=batch, k=None, tokens_per_s=base, tau=1.0,
                 speedup=1.0, same_tokens=True)]
    hf_specdec.enable(model)
    for backend, k, extra in [("hf_specdec", None, {})] + list(_runs(name)):
        model.generate(**{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4}, **extra)
        out, seconds = timed(lambda: model.generate(**kwargs, **extra))
        stats = hf_specdec.last_generation_stats(model)
        tps = batch * new_tokens / seconds
        rows.append(dict(model_shape=name, backend=backend, batch=batch, k=k, tokens_per_s=tps,
                         tau=stats.mean_accepted_length, speedup=tps / base, same_tokens=torch.equal(out, reference)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    members = [m for m in ("tiny-gemma4", "tiny-step3p5") if m in available_assets()]
    rows = [r for name in members for b in args.batch for r in bench_member(name, b, args.new_tokens, args.device)]
    env = environment()
    records = [{"bench": "e2e_tiny", **env, **r} for r in rows]
    print_table(rows, ["model_shape", "backend", "batch", "k", "tokens_per_s", "tau", "speedup", "same_tokens"])
    append_records("e2e_tiny", records)
    print(json.dumps({"bench": "e2e_tiny", **env, "rows": rows}))
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
