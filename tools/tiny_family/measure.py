"""τ and speed of an exported drafter through hf_specdec's speculative loop, on the bundled held-out snippets.

Used by the drafter CLIs (`train_assistant`, `train_dflash`) after training and by their `--measure-only`.
Decoding is greedy and in fp32; τ is tokens per target forward (bonus included). Tokens/s is measured on
CPU only, on one thread, where it says what the tiny family is for: a drafter that pays off without a GPU.
"""

import json
import pathlib
import time
from collections.abc import Callable, Sequence

import torch
from transformers import AutoTokenizer

import hf_specdec
from hf_specdec.assets import held_out_snippets

from .cli import device_name, versions

SPEED_BATCHES = (1, 4)


def load_pair(target_dir: pathlib.Path, drafter_dir: pathlib.Path, device):
    target = hf_specdec.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    drafter = hf_specdec.AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32).to(device).eval()
    return target, drafter


def prompt_batch(tokenizer, texts: list[str], device) -> dict:
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True).to(device)


def measure_tau(target, drafter, tokenizer, prompts: list[str], new_tokens: int, ks: Sequence[int]) -> dict:
    """Greedy speculative decoding of all prompts as one batch, per k: τ, the acceptance histogram, and
    whether the output equals plain greedy decoding token for token."""
    inputs = prompt_batch(tokenizer, prompts, target.device)
    kwargs = dict(**inputs, max_new_tokens=new_tokens, do_sample=False)
    plain = target.generate(**kwargs)
    result = {}
    for k in ks:
        out = target.generate(**kwargs, assistant_model=drafter, num_speculative_tokens=k)
        stats = hf_specdec.last_generation_stats(target)
        result[str(k)] = {"tau": round(stats.mean_accepted_length, 3), "histogram": stats.acceptance_histogram,
                          "generated_tokens": stats.num_generated_tokens, "same_as_plain": torch.equal(out, plain)}
        print(f"k={k}  tau {stats.mean_accepted_length:.3f}  histogram {stats.acceptance_histogram}", flush=True)
    return result


def measure_speed(target, drafter, tokenizer, prompts: list[str], new_tokens: int, k: int, batch: int,
                  method: str) -> dict:
    """Tokens/s of plain hf_specdec decoding and of `method` (the drafter at `k`): `batch` prompts at a time
    over all prompts, every row generating exactly `new_tokens` (after one warm-up call of each)."""
    groups = [prompts[i : i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
    row = {"batch": batch, "k": k, "new_tokens": new_tokens, "prompts": sum(map(len, groups))}
    for name, extra in (("plain", {}), (method, dict(assistant_model=drafter, num_speculative_tokens=k))):
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **extra)
        target.generate(**prompt_batch(tokenizer, groups[0], target.device), **{**kwargs, "max_new_tokens": 4,
                                                                                 "min_new_tokens": 4})
        start = time.perf_counter()
        for group in groups:
            target.generate(**prompt_batch(tokenizer, group, target.device), **kwargs)
        row[f"{name}_tokens_per_s"] = round(row["prompts"] * new_tokens / (time.perf_counter() - start), 1)
    row["speedup"] = round(row[f"{method}_tokens_per_s"] / row["plain_tokens_per_s"], 2)
    print("speed", json.dumps(row), flush=True)
    return row


def measure_drafter(
    target_dir: pathlib.Path, drafter_dir: pathlib.Path, device: torch.device, *, method: str, new_tokens: int,
    prompt_chars: int, ks: Callable[[torch.nn.Module], Sequence[int]], speed_ks: Callable[[dict], list[int]],
) -> dict:
    """τ per k in `ks(drafter)` on `device`, over the first `prompt_chars` characters of each held-out snippet;
    on CPU also plain vs `method` tokens/s at batch 1 and 4 for each k in `speed_ks(tau)`, `tau` being the
    per-k results keyed by `str(k)` in the order of `ks`."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target, drafter = load_pair(target_dir, drafter_dir, device)
    prompts = [s["text"][:prompt_chars] for s in held_out_snippets()]
    result = {"device": device_name(device), "prompts": f"{len(prompts)} held-out snippets, first "
              f"{prompt_chars} characters", "new_tokens": new_tokens, "greedy": True,
              "tau": measure_tau(target, drafter, tokenizer, prompts, new_tokens, ks(drafter)), **versions()}
    if device.type == "cpu":
        torch.set_num_threads(1)
        result["cpu_threads"] = 1
        result["speed"] = [measure_speed(target, drafter, tokenizer, prompts, new_tokens, k, batch, method)
                           for k in speed_ks(result["tau"]) for batch in SPEED_BATCHES]
    return result
