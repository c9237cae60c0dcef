"""soak: many generate calls on one set of models, recording device memory after every call.

    python -m benchmarks.soak [--calls 400] [--modes plain mtp step_mtp ...] [--quick | --smoke]

The bundled tiny family decodes call after call with the same model objects: the modes in turn (plain and
MTP on the tiny Gemma 4, DFlash when bundled, plain and MTP-3 on the tiny Step 3.5), batch sizes 1/3/8,
prompts of different lengths, generations several sliding windows long, every fourth call sampled. One
record per call: ``allocated_mib`` (torch.cuda.memory_allocated after the call), ``reserved_mib``,
``peak_mib`` (the call's peak), ``graphs`` (CUDA graphs the models keep for later calls), ``leaked_blocks`` (blocks still in use in any KV cache the call built:
must be 0), ``same_tokens`` (a greedy call equals the first call with the same inputs), and on the CPU
(or with ``--count-tensors``) ``live_tensors`` (tensors reachable from Python). Records go to
benchmarks/results/soak.jsonl. Exit status 1 when blocks leaked, a greedy call changed its answer, or
memory grew: the schedule repeats with a period of lcm(batches, lengths, 4) turns of all modes; once one
period has run after the last growth of a model's pooled K/V storage (which drops that model's graphs),
every kind of call — mode, batch, length, greedy or sampled — has allocated what later calls reuse
(storage pools, CUDA graphs, kernel plans), and no later call may hold more allocated memory
(``--tolerance-mib``), more live tensors or more graphs (see ``problems``).
"""

from __future__ import annotations

import gc
import math
import sys
import time
import warnings

import torch

import hf_specdec
from benchmarks.common import run_bench, synchronize
from hf_specdec.assets import asset_path, available_assets, held_out_snippets
from hf_specdec.cache import PagedKVCache, sizing

NAME = "soak"
COLUMNS = ["call", "backend", "batch", "k", "new_tokens", "sampled", "tokens_per_s", "allocated_mib", "peak_mib",
           "live_tensors", "graphs", "leaked_blocks", "same_tokens"]
PRESETS = {
    "smoke": dict(calls=12, batches=[1, 2], new_tokens=[12]),
    "quick": dict(calls=120),  # two full periods of the schedule with the default modes, batches and lengths
}
MODES = ("plain", "mtp", "dflash", "step_plain", "step_mtp")


def add_arguments(parser) -> None:
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="decoding modes, in turn (dflash only when its drafter is bundled)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 3, 8], help="batch sizes, in turn")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[192, 320],
                        help="new tokens per call, in turn (the tiny Gemma 4's window is 64, Step 3.5's 128)")
    parser.add_argument("--count-tensors", action="store_true", help="count live tensors after every call on CUDA too")
    parser.add_argument("--tolerance-mib", type=float, default=1.0)


def _models(args) -> dict:
    """mode -> (model, generate kwargs, k)."""
    load = hf_specdec.AutoModelForCausalLM.from_pretrained
    found = {}
    gemma = load(asset_path("tiny-gemma4"), dtype=args.dtype).to(args.device)
    gemma.generation_config.eos_token_id = None  # every row decodes the full length
    found["plain"] = (gemma, {}, None)
    assistant = load(asset_path("tiny-gemma4-assistant"), dtype=args.dtype).to(args.device)
    found["mtp"] = (gemma, dict(assistant_model=assistant, num_speculative_tokens=4), 4)
    if "tiny-gemma4-dflash" in available_assets():
        drafter = load(asset_path("tiny-gemma4-dflash"), dtype=args.dtype).to(args.device)
        found["dflash"] = (gemma, dict(assistant_model=drafter), None)
    step = load(asset_path("tiny-step3p5"), dtype=args.dtype).to(args.device)
    step.generation_config.eos_token_id = None
    found["step_plain"] = (step, {}, None)
    found["step_mtp"] = (step, dict(spec_mode="mtp", num_speculative_tokens=3), 3)
    return {m: found[m] for m in args.modes if m in found}


def _period(args, modes) -> int:
    """Calls after which the schedule repeats: every kind of call has run once."""
    return len(modes) * math.lcm(len(args.batches), len(args.new_tokens), 4)


def _schedule(args, modes: list[str]):
    """(call, mode, batch, new_tokens, sampled) of every call: the modes in turn, then the next batch size and
    length; every fourth turn samples. A greedy case repeats after lcm(len(batches), len(new_tokens)) turns."""
    for call in range(args.calls):
        mode = modes[call % len(modes)]
        turn = call // len(modes)
        batch, new_tokens = args.batches[turn % len(args.batches)], args.new_tokens[turn % len(args.new_tokens)]
        yield call, mode, batch, new_tokens, turn % 4 == 3


def _inputs(tokenizer, batch: int, device):
    snippets = held_out_snippets()
    texts = [snippets[i % len(snippets)]["text"][: 40 + 37 * (i % 5)] for i in range(batch)]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True).to(device)


class _CacheRecorder:
    """Holds the caches one call builds until they are checked, then lets them go."""

    def __init__(self):
        self.caches: list[PagedKVCache] = []
        self._build = sizing.cache_for_request

    def __enter__(self):
        def record(*a, **kw):
            self.caches.append(self._build(*a, **kw))
            return self.caches[-1]

        sizing.cache_for_request = record
        return self

    def __exit__(self, *exc):
        sizing.cache_for_request = self._build

    def leaked_blocks(self) -> int:
        leaked = sum(sum(c.num_used_blocks) for c in self.caches)
        self.caches = []
        return leaked


def _graph_stores(models: dict) -> dict:
    """Where the enabled models keep their CUDA graphs and pooled K/V storage (one store per model)."""
    stores = (getattr(getattr(model, "_hf_specdec", None), "graph_store", None) for model, _, _ in models.values())
    return {id(s): s for s in stores if s is not None}


def _kept(models: dict) -> dict:
    """``graphs``: CUDA graphs (target forwards and drafter calls) the models keep for later calls;
    ``pool_generation``: how often a model's pooled storage was replaced by a larger one (which drops the
    model's graphs: later calls capture them again)."""
    stores = _graph_stores(models).values()
    return {"graphs": sum(len(s.graphs) + len(s.calls) for s in stores),
            "pool_generation": sum(s.generation for s in stores)}


def _memory(device: str, count_tensors: bool) -> dict:
    synchronize()
    gc.collect()
    out = {"allocated_mib": None, "reserved_mib": None, "peak_mib": None, "live_tensors": None}
    if device == "cuda":
        mib = 2**20
        out |= {"allocated_mib": torch.cuda.memory_allocated() / mib,
                "reserved_mib": torch.cuda.memory_reserved() / mib, "peak_mib": torch.cuda.max_memory_allocated() / mib}
    if count_tensors or device != "cuda":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["live_tensors"] = sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))
    return out


def run(args, progress) -> list[dict]:
    from transformers import AutoTokenizer

    models = _models(args)
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))
    first_answers: dict[tuple, list] = {}  # token lists, not tensors: they must not count as live tensors
    rows = []
    progress.total(args.calls)
    for call, mode, batch, new_tokens, sampled in _schedule(args, list(models)):
        model, extra, k = models[mode]
        inputs = _inputs(tokenizer, batch, args.device)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sampling = dict(do_sample=True, temperature=0.8, top_p=0.95) if sampled else dict(do_sample=False)
        with _CacheRecorder() as recorder:
            start = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=new_tokens, pad_token_id=0, **sampling, **extra)
            synchronize()
            seconds = time.perf_counter() - start
        leaked = recorder.leaked_blocks()
        same = None
        if not sampled:
            key = (mode, batch, new_tokens)
            same = first_answers.setdefault(key, out.tolist()) == out.tolist()
        del out
        rows.append(dict(call=call, model_shape="tiny-step3p5" if mode.startswith("step") else "tiny-gemma4",
                         backend=mode, batch=batch, k=k, new_tokens=new_tokens, sampled=sampled,
                         tokens_per_s=batch * new_tokens / seconds, leaked_blocks=leaked, same_tokens=same,
                         **_kept(models), period=_period(args, list(models)),
                         **_memory(args.device, args.count_tensors)))
        progress.step(f"{mode} b{batch}")
    return rows


def problems(records: list[dict], tolerance_mib: float) -> list[str]:
    """What the soak found wrong: leaked blocks, changed answers, and growth in the steady state.

    The steady state starts one period (every kind of call once) after the last time a model's pooled
    storage grew (that drops its graphs, so the kinds run before must capture theirs again): from then on
    no call may hold more allocated memory (beyond ``tolerance_mib``) or more kept graphs than the call
    that ends that period, nor more live tensors than any call of that period left (modes keep different
    per-call state). A run too short to reach the steady state and one more call is reported as such,
    unless it is shorter than two periods (no verdict on growth)."""
    found = [f"call {r['call']}: {r['leaked_blocks']} blocks still in use" for r in records if r["leaked_blocks"]]
    found += [f"call {r['call']}: a greedy answer changed" for r in records if r["same_tokens"] is False]
    period = records[0]["period"] if records else 0
    if len(records) <= period:
        return found
    start = max((i for i in range(1, len(records))
                 if records[i].get("pool_generation") != records[i - 1].get("pool_generation")), default=0)
    if len(records) <= start + period:
        return found + [f"no steady state: the pooled storage last grew at call {records[start]['call']}, less than "
                        f"one period ({period} calls) and one call before the end; run more calls"]
    warmup = records[start:start + period]
    base = dict(warmup[-1])
    if base["live_tensors"] is not None:
        base["live_tensors"] = max(r["live_tensors"] for r in warmup)
    for r in records[start + period:]:
        if base["allocated_mib"] is not None and r["allocated_mib"] - base["allocated_mib"] > tolerance_mib:
            found.append(f"call {r['call']} ({r['backend']} b{r['batch']}): allocated grew "
                         f"{base['allocated_mib']:.1f} -> {r['allocated_mib']:.1f} MiB since call {base['call']}")
        for field in ("live_tensors", "graphs"):
            if base.get(field) is not None and r[field] > base[field]:
                found.append(f"call {r['call']} ({r['backend']} b{r['batch']}): {field} grew {base[field]} -> "
                             f"{r[field]} in the steady state (from call {base['call']})")
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    records = run_bench(sys.modules[__name__], argv)
    found = problems(records, _parsed(argv).tolerance_mib)
    for line in found:
        print(f"[soak] {line}", file=sys.stderr)
    return 1 if found else 0


def _parsed(argv):
    from benchmarks.common import parse_args

    return parse_args(sys.modules[__name__], argv)


if __name__ == "__main__":
    raise SystemExit(main())
