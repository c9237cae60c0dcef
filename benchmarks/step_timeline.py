"""step_timeline: a decode step's device time from the GPUs' own kernel timeline, one GPU against a device_map split
or tensor parallelism.

    PYTHONPATH=. python -m benchmarks.step_timeline [--shape gemma4-31b] [--layers 12] [--batch 1] [--gpus 2]
                                                   [--placement device_map|tp] [--new-tokens 33] [--trace-dir DIR]
                                                   [--weights bf16|fp8|nf4|int4] [--detail-layer L]

Tokens/s of a split model against one GPU moves with the host between processes (the one-GPU 31B/L12 row read
255-289 tok/s over three calls of one commit); the kernels' own timeline does not. This builds a random-weight
target of ``--shape``, enables it on one GPU, profiles one greedy ``generate`` call (torch.profiler, CUDA activity),
then splits it over ``--gpus`` GPUs with accelerate's balanced device map and profiles the same call. Per placement:
the median device time of a decode step (the distance between the starts of consecutive forwards: each begins with
hf_specdec's forward-metadata kernel), the time from a step's start to its first layer, each layer's span (from one
layer's first attention kernel to the next's), copies between GPUs a step, kernels a step per GPU, the time a step's
kernels keep the first GPU busy, and the kernels that take most of it. ``--placement tp`` profiles rank 0 of
``--gpus`` ranks that load the target with ``tp_plan="auto"`` instead (each rank profiles its own call). ``--trace-dir``
also writes each profile's Chrome trace (gzip; the device_map placement only).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics

import torch

from benchmarks.shapes import WEIGHTS

STEP_MARKER = "_forward_meta_kernel"  # the first kernel of every hf_specdec forward whose metadata the GPU builds
LAYER_MARKER = "_qkv_norm_rope_kernel"  # once per Gemma 4 attention layer
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
TOP = 12  # kernels named in a step's breakdown


def timeline(events: list[dict], skip: int = 4, detail_layer: int | None = None) -> dict:
    """Per-step figures from Chrome-trace events (``ph`` "X", ``cat``, ``name``, ``ts``, ``dur``, ``pid`` (the
    device)): ``step_us`` (median distance between consecutive :data:`STEP_MARKER` starts, after ``skip`` steps),
    ``first_layer_us`` and ``layer_us`` (median over the steps of the time to the first :data:`LAYER_MARKER` and of
    each layer's span), ``peer_copies`` (device-to-device copies between GPUs a step), ``kernels`` ({device:
    kernels a step}), ``busy_us`` (median time a step during which some kernel or copy runs on the device of the
    markers) and ``top`` ({kernel name: median microseconds a step that its kernels add to the busy time on that
    device}, the TOP largest: each kernel is charged for the part of its span past every kernel that started before
    it; with programmatic dependent launch a kernel's span includes its wait for the one before, so the spans
    themselves overlap and would charge a kernel for its predecessor's time). With ``detail_layer`` L, also
    ``layer_kernels``: the kernels of layer L (from its :data:`LAYER_MARKER` to the next) on the markers' device in
    the step whose span of that layer is the median, each as (name, start after the layer's start, duration, the
    microseconds it adds to the busy time). Steps are the intervals between markers; the last marker (the call's
    end) closes none."""
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
                    key=lambda e: e["ts"])
    starts = [e["ts"] for e in device if e["name"].startswith(STEP_MARKER)]
    if len(starts) < skip + 3:
        raise ValueError(f"{len(starts)} forwards in the trace (markers '{STEP_MARKER}'): need at least {skip + 3}; "
                         "generate more tokens")
    steps = list(zip(starts[skip:-1], starts[skip + 1:]))
    home = next(e["pid"] for e in device if e["name"].startswith(STEP_MARKER))
    firsts, layers, copies, kernels, busy, names, details = [], [], [], {}, [], {}, []
    for index, (begin, end) in enumerate(steps):
        inside = [e for e in device if begin <= e["ts"] < end]
        covered, reach, charged = 0.0, begin, []
        for e in (e for e in inside if e["pid"] == home):  # sorted by start: the union of their intervals
            stop = min(e["ts"] + e["dur"], end)
            added = max(0.0, stop - max(e["ts"], reach))
            covered += added
            reach = max(reach, stop)
            names.setdefault(e["name"][:60], [0.0] * len(steps))[index] += added
            charged.append((e, added))
        busy.append(covered)
        marks = [e["ts"] for e in inside if e["name"].startswith(LAYER_MARKER)]
        if marks:
            firsts.append(marks[0] - begin)
            layers.append([b - a for a, b in zip(marks, marks[1:])])
        if detail_layer is not None and detail_layer + 1 < len(marks):
            lo, hi = marks[detail_layer], marks[detail_layer + 1]
            details.append((hi - lo, [(e["name"][:60], e["ts"] - lo, e["dur"], added)
                                      for e, added in charged if lo <= e["ts"] < hi]))
        copies.append(sum("PtoP" in e["name"] for e in inside))
        for e in inside:
            if e.get("cat") == "kernel":
                kernels[e["pid"]] = kernels.get(e["pid"], 0) + 1
    width = min((len(spans) for spans in layers), default=0)
    details.sort(key=lambda detail: detail[0])
    return dict(layer_kernels=details[len(details) // 2][1] if details else [],
                step_us=statistics.median(b - a for a, b in steps),
                first_layer_us=statistics.median(firsts) if firsts else None,
                layer_us=[statistics.median(spans[i] for spans in layers) for i in range(width)],
                peer_copies=statistics.median(copies),
                kernels={device: count / len(steps) for device, count in sorted(kernels.items())},
                busy_us=statistics.median(busy),
                top=dict(sorted(((name, statistics.median(us)) for name, us in names.items()),
                                key=lambda item: -item[1])[:TOP]))


def _profile(model, ids, new_tokens: int, trace_path: str | None) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
    path = trace_path or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"step_timeline_{os.getpid()}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    if trace_path:
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as out:
            out.write(f.read())
    os.remove(path)
    return events


def _show(name: str, figures: dict, one: dict | None) -> None:
    ratio = f" ({one['step_us'] / figures['step_us']:.3f}x one GPU)" if one else ""
    layers = " ".join(f"{us:.0f}" for us in figures["layer_us"])
    print(f"{name}: {figures['step_us']:.0f} us a step{ratio}; first layer at {figures['first_layer_us'] or 0:.0f} us;"
          f" layers {layers}; copies between GPUs {figures['peer_copies']:.0f} a step; kernels a step "
          f"{ {d: round(k, 1) for d, k in figures['kernels'].items()} }; busy {figures['busy_us']:.0f} us a step")
    for kernel, us in figures["top"].items():
        print(f"    {us:8.1f} us  {kernel}")
    if figures["layer_kernels"]:
        print("  one layer's kernels (start after the layer's start, duration, what each adds to the busy time):")
    for kernel, start, duration, added in figures["layer_kernels"]:
        print(f"    {start:7.1f} {duration:7.1f} {added:7.1f} us  {kernel}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_timeline", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gemma4-31b", help="a Gemma 4 shape of benchmarks/shapes.py")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--weights", choices=WEIGHTS, default="bf16", help="the target's weights (one GPU only)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the split (0: one GPU only)")
    parser.add_argument("--placement", choices=("device_map", "tp"), default="device_map")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--trace-dir", default=None, help="write each profile's Chrome trace here (gzip)")
    parser.add_argument("--detail-layer", type=int, default=None,
                        help="also list this layer's kernels (0-based) in one step, each with what it adds")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_timeline reads the GPUs' kernel timeline: it needs CUDA")
    import hf_specdec
    from benchmarks.multi_gpu import _dispatch_balanced
    from benchmarks.shapes import random_prompt, target_for

    if args.weights != "bf16" and args.gpus >= 2:
        raise SystemExit("--weights other than bf16 is read on one GPU only (--gpus 0)")
    target = target_for(args.shape, args.layers, "cuda:0", torch.bfloat16, args.weights)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    ids = random_prompt(args.batch, args.prompt, target.config.vocab_size, "cuda:0")

    def trace(tag):
        return os.path.join(args.trace_dir, f"trace_{tag}.json") if args.trace_dir else None

    hf_specdec.enable(target)
    one = timeline(_profile(target, ids, args.new_tokens, trace("one_gpu")), detail_layer=args.detail_layer)
    _show("one GPU", one, None)
    if args.gpus >= 2 and args.placement == "tp":
        hf_specdec.disable(target)
        _show(f"tp over {args.gpus} GPUs (rank 0)", _tp_timeline(target, args), one)
    elif args.gpus >= 2:
        hf_specdec.disable(target)
        _dispatch_balanced(target, args.gpus, torch.bfloat16)
        hf_specdec.enable(target)
        split = timeline(_profile(target, ids, args.new_tokens, trace("device_map")))
        _show(f"device_map over {args.gpus} GPUs", split, one)
    return 0


def _tp_timeline(target, args) -> dict:
    """Rank 0's :func:`timeline` of ``args.gpus`` ranks that load ``target`` (saved to a folder) with tp_plan and
    profile the same call (benchmarks/multi_gpu.py spawns them; its "timeline" mode profiles)."""
    import tempfile
    from types import SimpleNamespace

    from benchmarks.multi_gpu import _tensor_parallel

    heads = {layer.self_attn.k_proj.out_features // layer.self_attn.head_dim for layer in target.model.layers}
    with tempfile.TemporaryDirectory() as folder:
        target.save_pretrained(folder)
        run = SimpleNamespace(device="cuda:0", gpus=args.gpus, batch=[args.batch], new_tokens=args.new_tokens,
                              repeats=1)
        got = _tensor_parallel(args.shape, ["timeline"], run, folder=folder,
                               replicate_attention=any(h % args.gpus for h in heads), layers=args.layers,
                               alpha=None, prompt=args.prompt, dtype="bfloat16")
    return got[("timeline", args.batch)]["timeline"]


if __name__ == "__main__":
    raise SystemExit(main())
