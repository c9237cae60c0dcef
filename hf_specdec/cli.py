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


def run_demo(args) -> int:
    import hf_specdec

    model, tokenizer = load_demo_model()
    if tokenizer is None:
        print("[hf_specdec demo] the bundled tiny model is not installed: decoding a small RANDOM Gemma 4 "
              "(completions are noise; the timings and the equality check are real).")
        input_ids = torch.randint(3, model.config.vocab_size, (len(DEMO_PROMPTS), 16))
        attention_mask = torch.ones_like(input_ids)
    else:
        tokenizer.padding_side = "left"
        batch = tokenizer(DEMO_PROMPTS, return_tensors="pt", padding=True)
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=args.max_new_tokens, do_sample=False)
    start = time.perf_counter()
    reference = model.generate(input_ids, **kwargs)
    hf_time = time.perf_counter() - start
    hf_specdec.enable(model)
    out = model.generate(input_ids, **kwargs)
    stats = hf_specdec.last_generation_stats(model)
    for row, prompt in enumerate(DEMO_PROMPTS if tokenizer is not None else []):
        completion = tokenizer.decode(out[row, input_ids.shape[1]:], skip_special_tokens=True)
        print(f"--- prompt {row}\n{prompt}\033[1m{completion}\033[0m")
    new_tokens = out.shape[0] * (out.shape[1] - input_ids.shape[1])
    print(f"\n{'decoder':<28}{'tokens/s':>10}  same tokens as transformers")
    print(f"{'transformers generate':<28}{new_tokens / hf_time:>10.1f}")
    print(f"{'hf_specdec plain':<28}{stats.tokens_per_s:>10.1f}  {torch.equal(out, reference)}")
    return 0 if torch.equal(out, reference) else 1


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
