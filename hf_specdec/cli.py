"""Command line: ``python -m hf_specdec demo`` / ``hf-specdec generate ...``."""

from __future__ import annotations

import argparse
import sys
import time

import torch

DEMO_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-specdec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="complete a few Python prompts with the bundled tiny model on CPU")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    gen = commands.add_parser("generate", help="generate from a prompt with any causal LM through hf_specdec")
    gen.add_argument("model", help="a model directory or hub id (loaded with transformers)")
    gen.add_argument("--prompt", help="the prompt text (or use --prompt-file)")
    gen.add_argument("--prompt-file", help="read the prompt from this file")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-stream", action="store_true", help="print the completion at the end instead of streaming")
    args = parser.parse_args(argv)
    return {"demo": run_demo, "generate": run_generate}[args.command](args)


def load_demo_model():
    """The bundled tiny Gemma 4 and its tokenizer, or a random tiny Gemma 4 (tokenizer None) if not bundled."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from hf_specdec.assets import asset_path

        path = asset_path("tiny-gemma4")
    except (ImportError, FileNotFoundError):
        return _random_gemma4(), None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def load_demo_drafters() -> dict[str, dict]:
    """generate() arguments of each bundled drafter of the tiny Gemma 4: {row name: kwargs}."""
    import hf_specdec
    from hf_specdec.assets import available_assets, asset_path

    drafters = {}
    if "tiny-gemma4-assistant" in available_assets():
        assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-assistant"),
                                                                    dtype=torch.float32)
        drafters["hf_specdec MTP (k=4)"] = dict(assistant_model=assistant, num_speculative_tokens=4)
    if "tiny-gemma4-dflash" in available_assets():
        drafter = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-dflash"),
                                                                  dtype=torch.float32)
        drafters["hf_specdec DFlash"] = dict(assistant_model=drafter)
    return drafters


def _random_gemma4():
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    s, f = "sliding_attention", "full_attention"
    config = Gemma4TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, global_head_dim=64, sliding_window=32, num_kv_shared_layers=2,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=512, layer_types=[s, s, f, s, s, f],
        final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    return Gemma4ForCausalLM(config).eval()


def _demo_inputs(model, tokenizer):
    if tokenizer is None:
        print("[hf_specdec demo] the bundled tiny model is not installed: decoding a small RANDOM Gemma 4 "
              "(completions are noise; the timings and the equality check are real).")
        input_ids = torch.randint(3, model.config.vocab_size, (len(DEMO_PROMPTS), 16))
        return input_ids, torch.ones_like(input_ids), []
    from hf_specdec.assets import held_out_snippets

    prompts = [s["text"][:160] for s in held_out_snippets()[:4]]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"], prompts


def run_demo(args) -> int:
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    model, tokenizer = load_demo_model()
    input_ids, attention_mask, prompts = _demo_inputs(model, tokenizer)
    drafters = load_demo_drafters() if tokenizer is not None else {}
    ok = _demo_table("tiny Gemma 4", model, tokenizer, input_ids, attention_mask, prompts, drafters, args)
    step = _load_step3p5_demo_model() if tokenizer is not None else None
    if step is not None:
        # batch 1: on CPU a verify of 4 rows x 4 tokens is compute-bound, and MTP-3 drafts cost 3 blocks
        ok &= _demo_table("tiny Step 3.5 (batch 1)", step, tokenizer, input_ids[:1], attention_mask[:1], prompts[:1],
                          {"hf_specdec MTP-3 (own layers)": dict(spec_mode="mtp", num_speculative_tokens=3)}, args)
    return 0 if ok else 1


def _load_step3p5_demo_model():
    from transformers import AutoModelForCausalLM

    from hf_specdec.assets import asset_path, available_assets

    if "tiny-step3p5" not in available_assets():
        return None
    return AutoModelForCausalLM.from_pretrained(asset_path("tiny-step3p5"), dtype=torch.float32).eval()


def _demo_table(title, model, tokenizer, input_ids, attention_mask, prompts, drafters, args) -> bool:
    """Decode the prompts with transformers, hf_specdec plain and each drafter; print completions and a table.
    Returns whether every decoder gave transformers' greedy tokens."""
    import hf_specdec

    kwargs = dict(attention_mask=attention_mask, max_new_tokens=args.max_new_tokens, do_sample=False)
    model.generate(input_ids, **{**kwargs, "max_new_tokens": 2})  # warm-up
    start = time.perf_counter()
    reference = model.generate(input_ids, **kwargs)
    hf_tps = reference.shape[0] * args.max_new_tokens / (time.perf_counter() - start)
    hf_specdec.enable(model)
    rows, last = [("transformers generate", hf_tps, None, True)], reference
    for name, extra in ({"hf_specdec plain": {}} | drafters).items():
        model.generate(input_ids, **{**kwargs, "max_new_tokens": 2}, **extra)  # warm-up
        last = model.generate(input_ids, **kwargs, **extra)
        stats = hf_specdec.last_generation_stats(model)
        tau = stats.mean_accepted_length if stats.spec_mode else None
        rows.append((name, stats.tokens_per_s, tau, torch.equal(last, reference)))
    print(f"===== {title}\n")
    for row, prompt in enumerate(prompts):
        completion = tokenizer.decode(last[row, input_ids.shape[1]:], skip_special_tokens=True)
        print(f"--- prompt {row}\n{prompt}\033[1m{completion}\033[0m\n")
    print(f"{'decoder':<32}{'tokens/s':>10}{'speed-up':>10}{'tau':>7}  same tokens as transformers")
    for name, tps, tau, same in rows:
        tau_text = f"{tau:7.2f}" if tau is not None else f"{'':>7}"
        print(f"{name:<32}{tps:>10.1f}{tps / hf_tps:>9.2f}x{tau_text}  {same}")
    print()
    return all(same for *_, same in rows)


def run_generate(args) -> int:
    from transformers import AutoTokenizer, TextStreamer

    import hf_specdec

    if (args.prompt is None) == (args.prompt_file is None):
        print("give exactly one of --prompt or --prompt-file", file=sys.stderr)
        return 2
    prompt = args.prompt if args.prompt is not None else open(args.prompt_file).read()
    torch.manual_seed(args.seed)
    model = hf_specdec.AutoModelForCausalLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    inputs = tokenizer([prompt], return_tensors="pt").to(model.device)
    streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=True)
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, streamer=streamer)
    if args.no_stream:
        print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    stats = hf_specdec.last_generation_stats(model)
    print(f"\n[{stats.num_generated_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s]", file=sys.stderr)
    return 0
