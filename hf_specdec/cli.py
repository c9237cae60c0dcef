"""Command line: ``python -m hf_specdec demo`` / ``hf-specdec generate ...`` / ``hf-specdec bench NAME``."""

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


# The benchmarks live in benchmarks/ beside the package (not installed with it); the names are listed here so
# that `bench --help` works without them.
BENCHES = {
    "decode": "plain decoding: transformers dynamic / static+compile vs hf_specdec, beside the bandwidth floor",
    "verify_cost": "one verify step (k+1 tokens per row) / one decode step",
    "draft_cost": "one draft step (Gemma 4 MTP, Step 3.5 MTP, DFlash) / one target step",
    "e2e_synthetic": "MTP end to end at a fixed acceptance rate (not lossless) beside plain decoding",
    "hf_native_assisted": "transformers' assisted decoding vs hf_specdec MTP on identical weights",
    "e2e_tiny": "the bundled tiny family: plain vs every speculative mode, real tau",
    "all": "every benchmark above at one size (run_all), then benchmarks/README.md and the plot",
}
BENCH_DESCRIPTION = (
    "Run one benchmark of benchmarks/ with a progress bar. It prints a table and one JSON line, appends its\n"
    "records to benchmarks/results/<name>.jsonl and writes benchmarks/results/<name>.png. Sizes: --smoke (CPU,\n"
    "seconds), --quick (the GPU size of run_all), or the full default. Needs a source checkout: run it from the\n"
    "repository root.\n\nbenchmarks:\n" + "\n".join(f"  {name:<20}{text}" for name, text in BENCHES.items())
)


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
    bench = commands.add_parser(
        "bench", help="run a benchmark of the source checkout's benchmarks/ folder (progress bar, JSON record, plot)",
        description=BENCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("name", choices=sorted(BENCHES), help="the benchmark to run (listed above)")
    bench.add_argument("options", nargs=argparse.REMAINDER,
                       help="the benchmark's own options, e.g. --smoke, --quick, --batch 1 8 "
                            "(`bench NAME --help` lists them)")
    args = parser.parse_args(argv)
    return {"demo": run_demo, "generate": run_generate, "bench": run_bench}[args.command](args)


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


def _import_benchmarks():
    """The source checkout's ``benchmarks`` package, or None when this install has none."""
    import importlib
    import pathlib

    checkout = pathlib.Path(__file__).resolve().parents[1]
    if (checkout / "benchmarks" / "common.py").exists() and str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    try:
        common = importlib.import_module("benchmarks.common")
    except ImportError:
        return None
    return common if hasattr(common, "run_bench") else None


def run_bench(args) -> int:
    """``hf-specdec bench NAME [options]``: the bench with a progress bar, its records and a plot."""
    import importlib

    common = _import_benchmarks()
    if common is None:
        print("hf-specdec bench needs the benchmarks/ folder of a source checkout of hf_specdec; this install has "
              "none (the benchmarks live outside the package). Clone the repository, run `pip install -e '.[dev]'` "
              "in it, and run `python -m hf_specdec bench NAME` from its root.", file=sys.stderr)
        return 2
    if args.name == "all":
        return importlib.import_module("benchmarks.run_all").main(args.options)
    module = importlib.import_module(f"benchmarks.{args.name}")
    records = common.run_bench(module, args.options, progress=True)
    if records:
        results_dir = common.parse_args(module, args.options).results_dir or common.RESULTS_DIR
        plot = importlib.import_module("benchmarks.report").plot(records, f"{results_dir}/{args.name}.png")
        if plot is not None:
            print(f"[hf-specdec bench] plot: {plot}", file=sys.stderr)
    failed = any(r.get("same_tokens") is False and not r.get("near_tie") for r in records)
    return 1 if failed else 0
