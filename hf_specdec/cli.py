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


BENCH_DESCRIPTION = """\
Run one benchmark of a source checkout's benchmarks/ folder with a progress bar. It prints a table and one
JSON line, appends its records to <results dir>/<name>.jsonl and writes <results dir>/<name>.png. The
results dir is --results-dir DIR (default ./hf_specdec_bench_results); --update-committed appends to the
checkout's committed benchmarks/results/ instead (with `all`: also rewrites benchmarks/README.md and its
plot). Sizes: --smoke (CPU, seconds), --quick (the GPU size of run_all), or the full default; a size the
device cannot hold is refused up front (exit status 2). Needs a source checkout: run it from the repository
root.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-specdec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="complete a few Python prompts with the bundled tiny model on CPU")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--repeats", type=int, default=3, help="timed runs per decoder, the best one reported")
    add_generate_parser(commands)
    add_bench_parser(commands)
    args = parser.parse_args(argv)
    return {"demo": run_demo, "generate": run_generate, "bench": run_bench}[args.command](args)


def add_bench_parser(commands) -> None:
    """``bench NAME [options]``: NAME is one of the benchmarks package's registry (benchmarks/__init__.py),
    or ``all``; without a benchmarks folder the help says where they come from."""
    package = _import_benchmarks()
    if package is not None:
        described = {**package.BENCHES, "all": getattr(package, "RUN_ALL", "every benchmark above (run_all)")}
        listing = "\n".join(f"  {name:<20}{text}" for name, text in described.items())
        names = list(described)
    else:
        listing = ("  (none here: this install has no benchmarks/ folder. The benchmarks come with a source\n"
                   "  checkout of hf_specdec: clone the repository, `pip install -e '.[dev]'` in it, and run\n"
                   "  `hf-specdec bench NAME` from its root.)")
        names = None
    bench = commands.add_parser(
        "bench", help="run a benchmark of the source checkout's benchmarks/ folder (progress bar, JSON record, plot)",
        description=BENCH_DESCRIPTION + "\nbenchmarks:\n" + listing,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("name", choices=names, metavar=None if names else "NAME",
                       help="the benchmark to run (listed above)" if names else "the benchmark to run")
    bench.add_argument("options", nargs=argparse.REMAINDER,
                       help="the benchmark's own options, e.g. --smoke, --quick, --batch 1 8, --results-dir DIR "
                            "(`bench NAME --help` lists them)")


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
        # the drafter's own block_size - 1 = 7: its τ still rises past the 4th draft (3.12 at k=4, 3.66 at k=7 on
        # the held-out snippets, hf_specdec/assets/README.md); on CPU k=4 and k=7 are within the timing noise
        drafters["hf_specdec DFlash (k=7)"] = dict(assistant_model=drafter, num_speculative_tokens=7)
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
    if args.repeats < 1 or args.max_new_tokens < 1:
        print(f"hf-specdec demo: error: --repeats and --max-new-tokens take a positive integer, got "
              f"{args.repeats} and {args.max_new_tokens}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    model, tokenizer = load_demo_model()
    input_ids, attention_mask, prompts = _demo_inputs(model, tokenizer)
    drafters = load_demo_drafters() if tokenizer is not None else {}
    ok = _demo_table(f"tiny Gemma 4 (batch {input_ids.shape[0]})", model, tokenizer, input_ids, attention_mask,
                     prompts, drafters, args)
    if drafters:
        # batch 1, the latency case speculative decoding is for: on CPU a batch of 4 rows x k+1 verified tokens
        # is already compute-bound, so a drafter's gain there is smaller
        ok &= _demo_table("tiny Gemma 4 (batch 1)", model, tokenizer, input_ids[:1], attention_mask[:1], prompts[:1],
                          drafters, args, show_completions=False)
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


def _demo_table(title, model, tokenizer, input_ids, attention_mask, prompts, drafters, args,
                show_completions=True) -> bool:
    """Decode the prompts with transformers, hf_specdec plain and each drafter; print completions and a table.
    Every decoder is timed alike: wall time around ``generate``, the best of ``--repeats`` runs taken in turn (a
    small model's step moves by 10-20% between runs on a shared CPU). Returns whether every decoder gave
    transformers' greedy tokens."""
    import hf_specdec

    kwargs = dict(attention_mask=attention_mask, max_new_tokens=args.max_new_tokens, do_sample=False)
    decoders = {"transformers generate": None, "hf_specdec plain": {}} | drafters
    best = dict.fromkeys(decoders, float("inf"))
    outputs, taus = {}, {}
    for repeat in range(-1, args.repeats):  # -1: the warm-up, untimed
        for name, extra in decoders.items():
            if extra is None:
                hf_specdec.disable(model)  # the reference is transformers' own generate
            else:
                hf_specdec.enable(model)
            start = time.perf_counter()
            out = model.generate(input_ids, **kwargs, **(extra or {}))
            seconds = time.perf_counter() - start
            if repeat >= 0:
                best[name] = min(best[name], seconds)
            outputs[name] = out
            stats = hf_specdec.last_generation_stats(model) if extra is not None else None
            taus[name] = stats.mean_accepted_length if stats is not None and stats.spec_mode else None
    hf_specdec.enable(model)
    reference = outputs["transformers generate"]
    tokens = reference.shape[0] * (reference.shape[1] - input_ids.shape[1])
    print(f"===== {title}\n")
    last = outputs[list(decoders)[-1]]
    for row, prompt in enumerate(prompts if show_completions else []):
        completion = tokenizer.decode(last[row, input_ids.shape[1]:], skip_special_tokens=True)
        print(f"--- prompt {row}\n{prompt}\033[1m{completion}\033[0m\n")
    print(f"{'decoder':<32}{'tokens/s':>10}{'speed-up':>10}{'tau':>7}  same tokens as transformers")
    for name in decoders:
        tau_text = f"{taus[name]:7.2f}" if taus[name] is not None else f"{'':>7}"
        print(f"{name:<32}{tokens / best[name]:>10.1f}{best['transformers generate'] / best[name]:>9.2f}x"
              f"{tau_text}  {torch.equal(outputs[name], reference)}")
    print()
    return all(torch.equal(out, reference) for out in outputs.values())


GENERATE_DESCRIPTION = """\
Generate a completion of one prompt through hf_specdec, streamed to stdout as it is accepted; a line of
statistics (tokens, tokens/s, tau) goes to stderr. Plain decoding by default; speculative with --assistant
(a Gemma 4 MTP assistant or a DFlash drafter) or --mode mtp (Step 3.5's own MTP layers). Greedy unless
--do-sample. Exit status 2 on invalid input, with the error naming the fix.

examples (bundled tiny models, CPU):
  hf-specdec generate tiny-gemma4 --prompt 'def fibonacci(n):' --assistant tiny-gemma4-assistant
  hf-specdec generate tiny-step3p5 --file prompt.py --mode mtp -k 3 --do-sample --temperature 0.7
"""


# generate() argument -> the option that sets it, for error messages written in generate()'s terms
CLI_NAMES = {"assistant_model": "--assistant", "spec_mode": "--mode", "num_speculative_tokens": "-k",
             "max_new_tokens": "--max-new-tokens"}


def add_generate_parser(commands) -> None:
    gen = commands.add_parser("generate", help="generate from a prompt with any causal LM through hf_specdec",
                              description=GENERATE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("model", help="a model directory, a hub id, or a bundled tiny model (tiny-gemma4, tiny-step3p5)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--file", "--prompt-file", dest="file", help="read the prompt from this file ('-': stdin)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the tokenizer's chat template (-it models; the tokenizer must have one)")
    spec = gen.add_argument_group("speculative decoding")
    spec.add_argument("--assistant", help="drafter: a Gemma 4 MTP assistant or a DFlash drafter (directory, hub id, "
                                          "or tiny-gemma4-assistant)")
    spec.add_argument("--mode", choices=["mtp", "dflash"], default=None,
                      help="spec_mode; inferred from --assistant when left out; Step 3.5 drafts with --mode mtp")
    spec.add_argument("-k", "--num-speculative-tokens", type=_k_argument, default=None, metavar="K",
                      help="drafts per step, or 'auto' (chosen per round from the measured acceptance and round "
                           "times; with --do-sample the draws then follow the rounds, so --seed no longer fixes the "
                           "tokens). Default: 'auto' when greedy; with --do-sample the drafter's own (MTP assistant "
                           "4, Step 3.5 its MTP layers, DFlash block_size - 1)")
    sampling = gen.add_argument_group("decoding")
    sampling.add_argument("--max-new-tokens", type=int, default=64)
    sampling.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    sampling.add_argument("--temperature", type=float, default=None, help="with --do-sample")
    sampling.add_argument("--top-k", type=int, default=None, help="with --do-sample")
    sampling.add_argument("--top-p", type=float, default=None, help="with --do-sample")
    sampling.add_argument("--repetition-penalty", type=float, default=None)
    sampling.add_argument("--stop", action="append", default=None, metavar="STRING",
                          help="stop when the completion ends with STRING (repeatable)")
    sampling.add_argument("--seed", type=int, default=0, help="torch seed (sampling)")
    run = gen.add_argument_group("model and output")
    run.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                     help="weights dtype (auto: the checkpoint's); the assistant is loaded in the same dtype")
    run.add_argument("--device", default=None, help="cpu, cuda, cuda:1, auto ... (default: cuda when present)")
    run.add_argument("--threads", type=int, default=None,
                     help="CPU threads (default: 1 for models under 100M parameters, else torch's default)")
    run.add_argument("--no-stream", action="store_true", help="print the completion at the end instead of streaming")


def _k_argument(text: str) -> int | str:
    """-k's value: a whole number of drafts, or 'auto' (generate() judges the number against the drafter)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number of drafts or 'auto', got {text!r}") from None


# device_map strategies accelerate takes besides a device
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def generate_argument_error(args) -> str | None:
    """What is wrong with the options of `generate`, naming the fix, or None: checked before any model loads.
    (Arguments only generate() can judge, such as -k against the drafter, come back as its ValueError.)"""
    if args.threads is not None and args.threads < 1:
        return f"--threads must be an integer >= 1, got {args.threads}; leave it out for the default"
    problem = _device_error(args.device)
    if problem:
        return problem
    if args.temperature is not None and args.temperature <= 0:
        return (f"--temperature must be > 0, got {args.temperature}; for greedy decoding leave out --do-sample "
                f"and --temperature")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        return f"--top-p must be in (0, 1], got {args.top_p}; leave it out to sample from every token"
    if args.top_k is not None and args.top_k < 0:
        return f"--top-k must be >= 0 (0: no top-k), got {args.top_k}"
    if args.repetition_penalty is not None and args.repetition_penalty <= 0:
        return f"--repetition-penalty must be > 0 (1: none), got {args.repetition_penalty}"
    if args.stop and "" in args.stop:
        return "--stop needs a non-empty STRING (an empty one would stop at once)"
    return None


def _device_error(device: str | None) -> str | None:
    """Why ``--device`` cannot be used with this torch, naming the fix, or None."""
    if device is None or device in DEVICE_MAPS:
        return None
    fix = "use --device cpu, or leave --device out (cuda when present, else cpu)"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device {device!r} is not a device: {fix}, or name one as cuda, cuda:1, mps, auto"
    if parsed.type == "cpu":
        return None
    if parsed.type == "meta":
        return f"--device meta holds no weights to generate with: {fix}"
    backend = getattr(torch, parsed.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        build = " (a CPU-only build)" if parsed.type == "cuda" and torch.version.cuda is None else ""
        return (f"--device {device}: this torch {torch.__version__}{build} has no usable {parsed.type} device; {fix}, "
                f"or install the torch build for your accelerator")
    count = getattr(backend, "device_count", None)
    if parsed.index is not None and count is not None and parsed.index >= count():
        return (f"--device {device}: there is no {parsed.type} device {parsed.index} (this machine has {count()}: "
                f"{parsed.type}:0 to {parsed.type}:{count() - 1})")
    return None


def run_generate(args) -> int:
    from transformers import AutoTokenizer, TextStreamer

    import hf_specdec

    problem = generate_argument_error(args)
    if problem:  # before any model loads
        print(f"hf-specdec generate: error: {problem}", file=sys.stderr)
        return 2
    try:
        prompt = _read_prompt(args)
        model = _load(args.model, dtype=_dtype(args.dtype), device_map=args.device or _default_device())
        if not hasattr(model, "_hf_specdec"):
            raise ValueError(f"{args.model} is a drafter ({type(model).__name__}), not a target: pass its target as "
                             f"the model and it as --assistant.")
        _check_tokenizer_files(args.model)
        tokenizer = AutoTokenizer.from_pretrained(_model_path(args.model))
        _set_threads(args.threads, model)
        extra = _speculative_kwargs(args, model)
        inputs = _tokenize(tokenizer, prompt, args.chat).to(model.device)
        streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        sampling = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p", "repetition_penalty")
                    if getattr(args, name) is not None}
        if args.stop:
            extra |= dict(stop_strings=args.stop, tokenizer=tokenizer)
        torch.manual_seed(args.seed)
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                             streamer=streamer, **sampling, **extra)
    except (ValueError, OSError) as err:
        print(f"hf-specdec generate: error: {err}", file=sys.stderr)
        if any(name in str(err) for name in CLI_NAMES):
            print("(here: " + ", ".join(f"{name} is {flag}" for name, flag in CLI_NAMES.items() if name in str(err))
                  + ")", file=sys.stderr)
        return 2
    if args.no_stream:
        print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    stats = hf_specdec.last_generation_stats(model)
    tau = f", tau {stats.mean_accepted_length:.2f} ({stats.spec_mode}, k={stats.num_speculative_tokens})" \
        if stats.spec_mode else ""
    print(f"[{stats.num_generated_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s{tau}]", file=sys.stderr)
    return 0


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.file == "-":
        return sys.stdin.read()
    with open(args.file, encoding="utf-8") as f:
        return f.read()


def _model_path(name: str):
    """A bundled tiny model's folder for its bare name (unless a folder of that name exists here)."""
    import pathlib

    from hf_specdec.assets import asset_path, available_assets

    return asset_path(name) if name in available_assets() and not pathlib.Path(name).exists() else name


# the files a saved tokenizer leaves in its folder (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt", "tokenizer.tiktoken")


def _check_tokenizer_files(name: str) -> None:
    """A local checkpoint folder without a tokenizer: say so (transformers names a missing converter or builds an
    empty tokenizer instead)."""
    import pathlib

    folder = pathlib.Path(_model_path(name))
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{name} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): save the base "
                         f"model's tokenizer there (tokenizer.save_pretrained('{name}')).")


def _dtype(name: str):
    return "auto" if name == "auto" else getattr(torch, name)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _set_threads(threads: int | None, model) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    elif model.device.type == "cpu" and model.num_parameters() < 100_000_000:
        torch.set_num_threads(1)  # small models: threads cost more than they give (as in the demo)


def _load(name: str, **kwargs):
    """``hf_specdec.AutoModelForCausalLM.from_pretrained`` of a command-line model name; what the loader raises
    besides ValueError / OSError (a missing quantization library, weights of other shapes) as a ValueError naming
    the checkpoint, which the command reports in one line."""
    import hf_specdec

    try:
        return hf_specdec.AutoModelForCausalLM.from_pretrained(_model_path(name), **kwargs)
    except (ImportError, RuntimeError) as err:
        raise ValueError(f"loading {name}: {err}") from err


def _speculative_kwargs(args, model) -> dict:
    """generate() arguments of the drafter options; the assistant is loaded beside the target, in its dtype."""
    extra = {}
    if args.assistant is not None:
        extra["assistant_model"] = _load(args.assistant, dtype=model.dtype, device_map=str(model.device))
    if args.mode is not None:
        extra["spec_mode"] = args.mode
    if args.num_speculative_tokens is not None:
        extra["num_speculative_tokens"] = args.num_speculative_tokens
    return extra


def _tokenize(tokenizer, prompt: str, chat: bool):
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        return ids
    return tokenizer([prompt], return_tensors="pt")


def _import_benchmarks():
    """The ``benchmarks`` package of the source checkout (the one beside this hf_specdec, else one importable from
    here), recognised by its registry ``BENCHES``; None when this install has none (a wheel has no benchmarks)."""
    import importlib
    import pathlib

    checkout = pathlib.Path(__file__).resolve().parents[1]
    if (checkout / "benchmarks" / "__init__.py").is_file() and str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    try:
        package = importlib.import_module("benchmarks")
    except ImportError:
        return None
    return package if isinstance(getattr(package, "BENCHES", None), dict) else None


NO_BENCHMARKS = ("hf-specdec bench: error: this install has no benchmarks/ folder: the benchmarks come with a "
                 "source checkout of hf_specdec, not with the installed package. Clone the repository, run "
                 "`pip install -e '.[dev]'` in it, and run `hf-specdec bench NAME` from its root.")


def run_bench(args) -> int:
    """``hf-specdec bench NAME [options]``: the bench with a progress bar, its records and a plot."""
    import importlib

    if _import_benchmarks() is None:
        print(NO_BENCHMARKS, file=sys.stderr)
        return 2
    common = importlib.import_module("benchmarks.common")
    prog = f"hf-specdec bench {args.name}"
    try:
        if args.name == "all":
            return importlib.import_module("benchmarks.run_all").main(args.options, prog=prog)
        module = importlib.import_module(f"benchmarks.{args.name}")
        records = common.run_bench(module, args.options, progress=True, prog=prog)
    except common.DoesNotFit:  # already said why, naming the fix
        return 2
    if records:
        results_dir = common.parse_args(module, args.options, prog).results_dir
        plot = importlib.import_module("benchmarks.report").plot(records, f"{results_dir}/{args.name}.png")
        if plot is not None:
            print(f"[hf-specdec bench] plot: {plot}", file=sys.stderr)
    failed = any(r.get("same_tokens") is False and not r.get("near_tie") for r in records)
    return 1 if failed else 0
