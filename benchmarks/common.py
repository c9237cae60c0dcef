"""Shared pieces of the benchmarks: environment facts, result records, timing, the printed table, and the
harness every bench runs under (size presets, progress, records, the last JSON line).

A bench is a module with

    NAME        the ``bench`` field of its records and the name of <results dir>/<NAME>.jsonl
    COLUMNS     the columns of its printed table
    PRESETS     {"smoke": {...}, "quick": {...}}: argument defaults of the two reduced sizes
    add_arguments(parser)
    run(args, progress) -> list[dict]     one dict per row (record fields beyond the environment)

and ``main = bench_main(module)``. ``--smoke`` runs on the CPU at a tiny size in seconds (what
tests/test_benchmarks_smoke.py runs); ``--quick`` is the size ``run_all`` uses on a GPU.

Records go to ``--results-dir`` (default ``./hf_specdec_bench_results``, outside the checkout's committed
results); the committed ``benchmarks/results/`` changes only with ``--update-committed``. Before it builds
anything, a bench estimates the memory of the largest model shape it would build (weights in the bench dtype
plus the KV cache of its largest batch, from benchmarks/shapes.py) and stops with exit status 2 when the
device does not have that much available, naming the fix (``--smoke``, ``--layers N``, a larger GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

import torch

# The committed results (benchmarks/results/): written only with --update-committed.
RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
# Where records go by default: a folder of the current directory, outside the committed results.
DEFAULT_RESULTS_DIR = pathlib.Path("hf_specdec_bench_results")
# Fields every record carries (issue #5); a bench adds its own.
RECORD_FIELDS = ("bench", "gpu", "commit", "torch", "transformers", "model_shape", "backend", "batch", "k",
                 "tokens_per_s")


def environment() -> dict:
    """GPU (or "cpu"), commit, torch and transformers versions: the fields every record carries, and ``settings``:
    the HF_SPECDEC_* environment variables set for the run (e.g. HF_SPECDEC_TP_SYMM_ALL_REDUCE=1), where any is.

    ``BENCH_COMMIT`` overrides the commit: a copied checkout (a lent GPU machine) may carry a stale HEAD."""
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=RESULTS_DIR.parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=RESULTS_DIR.parent, check=True).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    commit = os.environ.get("BENCH_COMMIT", commit)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    env = {"gpu": gpu, "commit": commit, "torch": torch.__version__, "transformers": transformers.__version__}
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("HF_SPECDEC_")}
    return env | ({"settings": settings} if settings else {})


def append_records(bench: str, records: list[dict], results_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Append one JSON line per record to <results_dir>/<bench>.jsonl (default ./hf_specdec_bench_results/)."""
    results_dir = pathlib.Path(results_dir) if results_dir is not None else DEFAULT_RESULTS_DIR
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{bench}.jsonl"
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    """(result, seconds) of one call, device work included."""
    synchronize()
    start = time.perf_counter()
    result = fn()
    synchronize()
    return result, time.perf_counter() - start


def print_table(rows: list[dict], columns: list[str]) -> None:
    if not rows:
        print("(no rows)")
        return
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(value) -> str:
    if isinstance(value, dict):  # settings: NAME=value ...
        return " ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "" if value is None else str(value)


# ---------------------------------------------------------------------------------------------- measuring


def copy_bandwidth_gb_s(device: str, num_bytes: int | None = None, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    num_bytes = num_bytes or (1 << 30 if device == "cuda" else 1 << 24)
    x = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    _, seconds = timed(lambda: [y.copy_(x) for _ in range(repeats)])
    del x, y
    return 2 * num_bytes * repeats / seconds / 1e9


def decode_rate(generate, batch: int, new_tokens: int, stats=None, repeats: int = 1, snapshot=None,
                warmups: int = 1, before_pair=None, pooled: bool = False) -> dict:
    """Steady-state decoding speed of ``generate(n)`` (n new tokens per row), prefill excluded:
    tokens/s = batch * (N - 1) / (t(N) - t(1)), after one warm-up call of length 1 and ``warmups`` of length N;
    with ``repeats`` > 1 the median of that many (t(1), t(N)) pairs. ``first_token_ms``: the median t(1) over the
    pairs, a whole call of one new token (the time to the first token: the call's setup, the prompt's forward and its
    token; a host-bound call's time moves by 1.5x from call to call on a lent GPU machine, so one t(1) says little).

    ``stats(result)`` may return the number of target forwards of a call; with it the result also has
    ``step_ms`` (time per target forward, from the same differencing) and ``forwards``. ``snapshot()``, called
    after each long call, is returned as ``snapshot`` for the pair the result comes from. ``before_pair(i)`` is called
    before the i-th timed pair (e.g. to draw its synthetic acceptances from seed i). ``pooled``: the rate of all the
    pairs together (their tokens over their summed times; ``step_ms`` over their summed forwards) instead of the
    median pair's, for pairs that differ by more than timing noise (each on its own draws). ``snapshots``: every
    pair's snapshot."""
    generate(1)  # warm-up: kernels, autotuning, allocator, compile
    for _ in range(warmups):
        generate(new_tokens)
    pairs = []
    for i in range(max(1, repeats)):
        if before_pair is not None:
            before_pair(i)
        short, t_short = timed(lambda: generate(1))
        f_short = stats(short) if stats else None
        out, t_long = timed(lambda: generate(new_tokens))
        forwards = stats(out) - f_short if stats else None
        pairs.append(dict(elapsed=t_long - t_short, out=out, t_long=t_long, t_short=t_short, forwards=forwards,
                          snapshot=snapshot() if snapshot else None))
    pair = sorted(pairs, key=lambda p: p["elapsed"])[len(pairs) // 2]
    elapsed, forwards = pair["elapsed"], pair["forwards"]
    if pooled:  # the pairs' mean: their tokens over their summed times (and forwards)
        elapsed = sum(p["elapsed"] for p in pairs) / len(pairs)
        forwards = sum(p["forwards"] for p in pairs) / len(pairs) if stats else None
    if elapsed <= 0:
        raise RuntimeError(f"generating {new_tokens} tokens per row took no longer than generating 1 (t(N) - t(1) = "
                           f"{elapsed * 1e3:.1f} ms, the {'mean' if pooled else 'median'} of {len(pairs)} pairs): the "
                           "calls' other work (a slow prefill) varies more than the decode takes, so no rate can be "
                           "given; raise --new-tokens or --repeats")
    result = {"tokens_per_s": batch * (new_tokens - 1) / elapsed, "output": pair["out"], "seconds": pair["t_long"],
              "first_token_ms": 1e3 * sorted(p["t_short"] for p in pairs)[len(pairs) // 2], "repeats": len(pairs),
              "snapshot": pair["snapshot"], "snapshots": [p["snapshot"] for p in pairs]}
    if stats:
        result |= {"step_ms": 1e3 * elapsed / max(forwards, 1), "forwards": forwards}
    return result


def first_mismatch(reference: torch.Tensor, other: torch.Tensor, logits=None):
    """None if the token tensors agree, else {"step", "top2_gap"} of the first differing new token
    (top-2 gap of the reference logits there when given: bf16 near-ties may flip, docs/architecture.md,
    "Exactness")."""
    if reference.shape == other.shape and torch.equal(reference, other):
        return None
    width = min(reference.shape[1], other.shape[1])
    diff = (reference[:, :width] != other[:, :width]).any(dim=0).nonzero()
    column = int(diff[0]) if len(diff) else width
    result = {"column": column, "top2_gap": None}
    if logits is not None:
        step = column - (reference.shape[1] - len(logits))
        if 0 <= step < len(logits):
            top2 = logits[step].float().topk(2, dim=-1).values
            result["top2_gap"] = round(float((top2[:, 0] - top2[:, 1]).min()), 4)
    return result


def free_device_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- harness


class Progress:
    """What a bench reports while it runs: ``total(n)`` once, then ``step(label)`` per finished case."""

    def __init__(self, enabled: bool = False, desc: str = ""):
        self.bar = None
        self.enabled = enabled
        self.desc = desc

    def total(self, n: int) -> None:
        if self.enabled and self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=n, desc=self.desc, unit="case", file=sys.stderr)

    def step(self, label: str = "") -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


AUTO_WARMUPS = 5  # warm-up calls of a num_speculative_tokens="auto" row (module docstring of e2e_synthetic)


def k_value(text: str):
    """A ``--k`` value: a number of drafts, or "auto" (chosen per round)."""
    return text if text == "auto" else int(text)


def add_pair_arguments(parser, prompt_help: str, layers_help: str) -> None:
    """``--layers``, ``--repeats``, ``--prompt`` and ``--new-tokens`` of the benches that time transformers' and
    hf_specdec's generate on the same weights."""
    parser.add_argument("--layers", type=int, default=None, help=layers_help)
    parser.add_argument("--repeats", type=int, default=3, help="median of this many timed (1, N) pairs")
    parser.add_argument("--prompt", type=int, default=256, help=prompt_help)
    parser.add_argument("--new-tokens", type=int, default=64)


def rows_per_model(args, progress, model_rows) -> list[dict]:
    """``model_rows(name, folder, args)`` for each of ``args.models`` in turn, each with a fresh temporary folder
    (checkpoints written for the run) and the device memory freed before the next."""
    import tempfile

    progress.total(len(args.models))
    rows = []
    for name in args.models:
        with tempfile.TemporaryDirectory() as folder:
            rows += model_rows(name, folder, args)
        free_device_memory()
        progress.step(name)
    return rows


def build_parser(module, prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog or f"python -m benchmarks.{module.NAME}",
                                     description=(module.__doc__ or "").strip().splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, seconds (what the tests run)")
    size.add_argument("--quick", action="store_true", help="the reduced GPU size run_all uses")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present; --smoke: cpu)")
    parser.add_argument("--no-record", action="store_true", help="do not write the records (<bench>.jsonl)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--results-dir", default=None, type=pathlib.Path,
                       help=f"where <bench>.jsonl (and the plot of `hf-specdec bench`) go (default "
                            f"./{DEFAULT_RESULTS_DIR})")
    where.add_argument("--update-committed", action="store_true",
                       help="append the records to the checkout's committed benchmarks/results/ instead")
    parser.add_argument("--skip-memory-check", action="store_true",
                        help="build the shapes even where the memory estimate says they do not fit")
    parser.add_argument("--run-id", default=None, help="tag the records with this id (run_all sets one per run)")
    module.add_arguments(parser)
    return parser


def parse_args(module, argv: list[str] | None, prog: str | None = None):
    parser = build_parser(module, prog)
    first, _ = parser.parse_known_args(argv)
    preset = "smoke" if first.smoke else "quick" if first.quick else None
    if preset:
        parser.set_defaults(**module.PRESETS.get(preset, {}))
    args = parser.parse_args(argv)
    args.preset = preset or "full"
    if args.device is None:
        args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.update_committed:
        args.results_dir = RESULTS_DIR
    elif args.results_dir is None:
        args.results_dir = DEFAULT_RESULTS_DIR
    return args


# ---------------------------------------------------------------------------------------------- does it fit


class DoesNotFit(SystemExit):
    """A bench asked for a device or a shape this machine cannot hold: exit status 2, like an argparse error.
    ``message`` names the fix; it has been printed to stderr when this is raised."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _meta_model(model_class, config, dtype: torch.dtype):
    """``model_class(config)`` on the meta device in ``dtype``: the real parameter shapes, no memory, no init."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return model_class(config)
    finally:
        torch.set_default_dtype(previous)


def shape_memory(args) -> list[dict]:
    """What each benchmark shape (benchmarks/shapes.py) the arguments name needs at least: its weights in the
    bench dtype plus the KV cache of the largest batch at prompt + new tokens + drafts, one dict per shape.

    Read from the arguments the benches share: ``--shapes`` / ``--shape`` / ``--models`` (the bundled tiny
    models are not shapes and need no check), ``--layers`` (``--step-layers`` for Step 3.5), ``--batch``,
    ``--prompt``, ``--new-tokens``, ``--k``. The models are built on the meta device, so this takes no memory."""
    from benchmarks import shapes

    names = _as_list(getattr(args, "shapes", None)) + _as_list(getattr(args, "shape", None))
    names += _as_list(getattr(args, "models", None))
    batch = max(_as_list(getattr(args, "batch", None)) or [1])
    # a k of "auto" drafts at most 7 per round (e2e_synthetic.AUTO_K_MAX)
    context = sum(max([7 if v == "auto" else v for v in _as_list(getattr(args, name, None))] or [0])
                  for name in ("prompt", "new_tokens", "k"))
    needs = []
    for name in dict.fromkeys(names):
        if name in shapes.GEMMA4_TARGETS:
            from transformers import Gemma4ForCausalLM

            layers = getattr(args, "layers", None)
            config = shapes.gemma4_config(name, layers)
            model = _meta_model(Gemma4ForCausalLM, config, args.dtype)
        elif name in shapes.STEP3P5:
            from hf_specdec.models.step3p5 import Step3p5ForCausalLM

            layers = getattr(args, "step_layers", None) or getattr(args, "layers", None)
            config = shapes.step3p5_config(name, layers)
            model = _meta_model(Step3p5ForCausalLM, config, args.dtype)
        elif name in shapes.GPT_OSS:
            from transformers import GptOssForCausalLM

            layers = getattr(args, "layers", None)
            config = shapes.gpt_oss_config(name, layers)
            model = _meta_model(GptOssForCausalLM, config, args.dtype)
        else:
            continue
        weights = sum(t.numel() * t.element_size()
                      for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
        kv = _kv_bytes(config, batch, max(context, 1), torch.empty((), dtype=args.dtype).element_size())
        needs.append(dict(shape=shapes.shape_name(name, layers), layers=config.num_hidden_layers, weight_bytes=weights,
                          kv_bytes=kv, bytes=weights + kv, batch=batch, context=context))
        del model
    return needs


def _kv_bytes(config, batch: int, context: int, element: int) -> int:
    """Bytes of K and V for ``context`` tokens per row (a window on sliding layers) in each layer owning K/V."""
    from benchmarks import shapes

    if hasattr(config, "layer_num_kv_heads"):  # Step 3.5 (its main layers; the MTP layers are a few more)
        layers = [(config.layer_num_kv_heads(i), config.layer_head_dim(i), config.layer_sliding_window(i))
                  for i in range(config.num_hidden_layers)]
    else:
        layers = list(shapes._kv_layers(config))
    return sum(2 * batch * min(context, window or context) * heads * dim * element for heads, dim, window in layers)


def available_memory(device: str) -> int | None:
    """Bytes free on ``device``: the GPU's free memory, or the machine's available RAM for the CPU; None where
    it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else None
    if device.type != "cpu":
        return None
    from hf_specdec.cache.sizing import available_host_memory

    return available_host_memory()


def fit_problem(module, args) -> str | None:
    """Why this bench cannot run here as asked (an absent device, a shape larger than the memory available),
    naming the fix; None when it can (or when ``--skip-memory-check`` was given)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return (f"--device {args.device}, but this torch ({torch.__version__}) sees no CUDA device. Leave --device "
                f"out (cuda when present, else cpu), or run --smoke: tiny shapes on the CPU, seconds.")
    if args.skip_memory_check:
        return None
    needs = shape_memory(args)
    free = available_memory(args.device) if needs else None
    if free is None:
        return None
    worst = max(needs, key=lambda n: n["bytes"])
    if worst["bytes"] <= free:
        return None
    dtype = str(args.dtype).replace("torch.", "")
    where = "RAM available" if device.type == "cpu" else f"free on {args.device}"
    return (f"{module.NAME} would build {worst['shape']} ({worst['layers']} layers) in {dtype} on {args.device}: "
            f"{worst['weight_bytes'] / 1e9:.1f} GB of weights + {worst['kv_bytes'] / 1e9:.1f} GB of KV cache "
            f"(batch {worst['batch']}, {worst['context']} tokens) = at least {worst['bytes'] / 1e9:.1f} GB, but "
            f"this machine has {free / 1e9:.1f} GB {where}. Run it with --smoke (tiny shapes on the CPU, seconds), "
            f"cut the depth with --layers N, or run it on a GPU that holds the shape (--quick fits one 80 GB "
            f"H100); --skip-memory-check builds it anyway.")


def check_fits(module, args, prog: str | None = None) -> None:
    """Raise DoesNotFit (exit status 2), after printing why, when ``fit_problem`` finds one."""
    problem = fit_problem(module, args)
    if problem:
        print(f"{prog or 'python -m benchmarks.' + module.NAME}: error: {problem}", file=sys.stderr)
        raise DoesNotFit(problem)


# ---------------------------------------------------------------------------------------------- running


def run_bench(module, argv: list[str] | None = None, progress: bool = False, quiet: bool = False,
              prog: str | None = None) -> list[dict]:
    """Run one bench: rows -> records (environment + command), table, results file, one JSON line last.

    First checks that the device exists and holds the shapes asked for (``check_fits``): DoesNotFit
    (SystemExit 2) with the fix printed, before anything is built. ``prog`` names the command in messages."""
    args = parse_args(module, argv, prog)
    check_fits(module, args, prog)
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads cost more than they give
    bar = Progress(progress, desc=module.NAME)
    try:
        rows = module.run(args, bar)
    finally:
        bar.close()
    env = environment()
    command = " ".join(["python -m benchmarks." + module.NAME] + [shlex.quote(a) for a in _reproducing(argv or [])])
    run_id = args.run_id or time.strftime("%Y%m%dT%H%M%S")
    records = [{"bench": module.NAME, **env, **row, "command": command, "preset": args.preset, "run_id": run_id}
               for row in rows]
    for record in records:
        for field in RECORD_FIELDS:
            record.setdefault(field, None)
    if not quiet:
        print_table(records, module.COLUMNS)
    if not args.no_record:
        path = append_records(module.NAME, records, args.results_dir)
        print(f"[{module.NAME}] records appended to {path}", file=sys.stderr)
    print(json.dumps({"bench": module.NAME, **env, "command": command, "rows": rows}, default=str))
    return records


_WHERE_FLAGS = ("--no-record", "--update-committed", "--skip-memory-check")


def _reproducing(argv: list[str]) -> list[str]:
    """argv without the options that only say where records go or skip a check (they do not change what is
    measured)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--run-id", "--results-dir"):
            skip = True
        elif a not in _WHERE_FLAGS and not a.startswith(("--run-id=", "--results-dir=")):
            out.append(a)
    return out


def bench_main(module):
    def main(argv: list[str] | None = None) -> int:
        records = run_bench(module, argv if argv is not None else sys.argv[1:])
        # a bench that checks tokens fails when a check failed outright (near-ties are reported, not failed)
        return 1 if any(r.get("same_tokens") is False and not r.get("near_tie") for r in records) else 0

    return main
