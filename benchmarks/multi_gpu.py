"""multi_gpu: hf_specdec over several devices — accelerate device_map, offload, transformers tensor parallelism.

    python -m benchmarks.multi_gpu [--gpus 2] [--placements device_map tp offload] [--modes none mtp dflash]
                                   [--batch 1 4] [--new-tokens 32] [--repeats 1] [--shape tiny | gemma4-31b ...]
                                   [--layers N]
                                   [--quick | --smoke]

The bundled tiny family (fp32: tiny-gemma4 with its MTP assistant and DFlash drafter, tiny-step3p5 with its MTP
layers), each placement beside the single-device run of the same weights in the same process:
- ``device_map``: the decoder layers split evenly over ``--gpus`` GPUs (accelerate big-model inference);
- ``offload``: half the layers (and on the CPU the embedding and LM head too) in CPU memory on a GPU, on disk on
  the CPU, loaded around each forward by accelerate's hooks;
- ``tp``: ``tp_plan="auto"`` on ``--gpus`` ranks (NCCL; gloo on the CPU with 2 ranks), spawned by this bench the
  way torchrun starts them; Gemma 4 with its attention replicated (its tiny full layers have one KV head).
Rows: tokens/s (steady state, prefill excluded), ``speedup_vs_plain`` (the same placement without drafts),
``speedup_vs_single_gpu`` (the same mode on one device), ``same_tokens`` (against that single-device run).
Where fewer GPUs exist than a placement needs, its rows say ``skipped`` and why.

``--shape gemma4-31b --layers 12`` (any Gemma 4 shape of benchmarks/shapes.py) runs a random-weight bf16 target of that
shape instead: plain decoding and MTP with its assistant at a synthetic acceptance of ``--alpha`` (k=3, as
e2e_synthetic), on one GPU, then split over ``--gpus`` GPUs by accelerate's balanced device map (what
``device_map="balanced"`` gives), then under ``tp_plan="auto"`` (the ranks load the same weights from a checkpoint
written to a temporary folder). ``same_tokens`` compares plain decoding only (the synthetic rows are not lossless).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile

import torch

from benchmarks.common import bench_main, decode_rate, free_device_memory

NAME = "multi_gpu"
COLUMNS = ["model_shape", "placement", "gpus", "spec_mode", "batch", "tokens_per_s", "speedup_vs_plain",
           "speedup_vs_single_gpu", "same_tokens", "skipped"]
PRESETS = {
    "smoke": dict(batch=[2], new_tokens=6, placements=["offload", "tp", "device_map"], gpus=2),
    "quick": dict(batch=[1], new_tokens=16),
}
MODES = {"tiny-gemma4": ["none", "mtp", "dflash"], "tiny-step3p5": ["none", "mtp"]}
K = 3
# CPU gloo runs whose rank died on SIGABRT run again this many times at most (see _tensor_parallel)
CPU_ABORT_RERUNS = 1


def add_arguments(parser) -> None:
    parser.add_argument("--gpus", type=int, default=max(2, torch.cuda.device_count()),
                        help="GPUs for device_map and tp rows (tp on the CPU: this many gloo ranks)")
    parser.add_argument("--placements", nargs="+", default=["device_map", "tp", "offload"],
                        choices=["device_map", "tp", "offload"])
    parser.add_argument("--modes", nargs="+", default=["none", "mtp", "dflash"], choices=["none", "mtp", "dflash"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1,
                        help="each row the median of this many (t(1), t(N)) pairs (a rate from one pair moves by ~10%% "
                             "between calls at 32 new tokens: raise both for placements compared within a few %%)")
    parser.add_argument("--shape", default="tiny",
                        help="'tiny' (the bundled family, fp32) or a Gemma 4 shape of benchmarks/shapes.py (bf16)")
    parser.add_argument("--layers", type=int, default=None, help="cut a shape to this many layers")
    parser.add_argument("--alpha", type=float, default=0.8, help="synthetic acceptance of a shape's MTP rows")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens of a shape's rows")


def run(args, progress) -> list[dict]:
    if args.shape != "tiny":
        return _shape_rows(args, progress)
    progress.total(len(MODES) * len(args.placements))
    rows = []
    for shape, modes in MODES.items():
        modes = [m for m in modes if m in args.modes]
        single = _measure_all(_load(shape, args, {"": args.device}), shape, modes, args)
        for placement in args.placements:
            measured = _placement(placement, shape, modes, args)
            rows += _rows(shape, placement, measured, single, args)
            progress.step(f"{shape} {placement}")
            free_device_memory()
    return rows


def _placement(placement: str, shape: str, modes: list[str], args) -> dict | str:
    """{(mode, batch): measurement} of one placement, or why it was skipped."""
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    if placement == "device_map":
        if gpus < 2 or gpus < args.gpus:
            return f"device_map needs {max(2, args.gpus)} GPUs, {gpus} present"
        return _measure_all(_load(shape, args, _split_map(shape, args, [f"cuda:{i}" for i in range(args.gpus)])),
                            shape, modes, args)
    if placement == "offload":
        with tempfile.TemporaryDirectory() as folder:
            elsewhere = "cpu" if gpus else "disk"
            model = _load(shape, args, _offload_map(shape, args, elsewhere), offload_folder=folder)
            return _measure_all(model, shape, modes, args)
    if gpus and gpus < args.gpus:
        return f"tp needs {args.gpus} GPUs, {gpus} present"
    return _tensor_parallel(shape, modes, args)


# ---------------------------------------------------------------- models and placements


def _asset(name: str) -> str:
    from hf_specdec.assets import asset_path

    return str(asset_path(name))


def _load(shape: str, args, device_map=None, **kwargs):
    import hf_specdec

    model = hf_specdec.AutoModelForCausalLM.from_pretrained(_asset(shape), dtype=torch.float32,
                                                            device_map=device_map, **kwargs)
    model.generation_config.eos_token_id = None  # every row runs the full length
    return model


def _modules(shape: str) -> tuple[list[str], int, bool]:
    """(the top-level module names of a model of this shape, apart from its layers; its layer count; whether its LM
    head is tied to its input embedding)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(_asset(shape))
    text = config.get_text_config()
    extra = ["model.rotary_emb", "model.embed_tokens", "model.norm", "lm_head"]
    if shape == "tiny-gemma4":
        extra += ["model.embed_tokens_per_layer", "model.per_layer_model_projection", "model.per_layer_projection_norm"]
    layers = text.num_hidden_layers + (getattr(text, "num_nextn_predict_layers", 0) or 0)
    return extra, layers, bool(config.tie_word_embeddings)


def _split_map(shape: str, args, devices: list[str]) -> dict[str, str]:
    """Layers split evenly over ``devices``; embedding on the first, norm and head on the last (a head tied to the
    embedding is one tensor: it stays on the first)."""
    extra, layers, tied = _modules(shape)
    placement = {name: devices[0] for name in extra}
    placement.update({"model.norm": devices[-1], "lm_head": devices[-1]} if not tied else {})
    placement.update({f"model.layers.{i}": devices[i * len(devices) // layers] for i in range(layers)})
    return placement


def _offload_map(shape: str, args, elsewhere: str) -> dict[str, str]:
    """Odd layers ``elsewhere`` ("cpu" memory on a GPU, "disk" on the CPU), the rest on the device; on the CPU the
    embedding, final norm and (tied) LM head too."""
    extra, layers, _ = _modules(shape)
    home = args.device if args.device != "cuda" else "cuda:0"
    placement = {name: home for name in extra}
    if elsewhere == "disk":
        placement.update({name: "disk" for name in ("model.embed_tokens", "model.norm", "lm_head")})
        if shape == "tiny-gemma4":
            placement["model.embed_tokens_per_layer"] = "disk"
    placement.update({f"model.layers.{i}": elsewhere if i % 2 else home for i in range(layers)})
    return placement


def _drafter(shape: str, mode: str):
    import hf_specdec

    if mode == "none":
        return {}
    if shape == "tiny-step3p5":
        return dict(spec_mode="mtp", num_speculative_tokens=K)
    name = "tiny-gemma4-assistant" if mode == "mtp" else "tiny-gemma4-dflash"
    drafter = hf_specdec.AutoModelForCausalLM.from_pretrained(_asset(name), dtype=torch.float32)
    return dict(assistant_model=drafter, spec_mode=mode, num_speculative_tokens=K)


def _prompt(batch: int, device: str):
    from transformers import AutoTokenizer

    from hf_specdec.assets import held_out_snippets

    tokenizer = AutoTokenizer.from_pretrained(_asset("tiny-gemma4"))
    tokenizer.padding_side = "left"
    texts = [held_out_snippets()[i]["text"][: 80 - 11 * i] for i in range(batch)]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)


def _measure_all(model, shape: str, modes: list[str], args) -> dict:
    from hf_specdec.runtime.placement import input_device

    device = str(input_device(model))
    out = {}
    for mode in modes:
        extra = _drafter(shape, mode)
        for batch in args.batch:
            ids, mask = _prompt(batch, device)
            measured = decode_rate(lambda n: model.generate(ids, attention_mask=mask, max_new_tokens=n,
                                                            do_sample=False, **extra), batch, args.new_tokens,
                                   repeats=getattr(args, "repeats", 1))
            out[(mode, batch)] = dict(tokens_per_s=measured["tokens_per_s"], output=measured["output"].cpu().tolist())
    return out


def _rows(shape: str, placement: str, measured, single: dict, args) -> list[dict]:
    gpus = {"device_map": args.gpus, "tp": args.gpus, "offload": 1, "single": 1}[placement]
    gpus = gpus if args.device.startswith("cuda") else 0
    rows = []
    for (mode, batch), base in single.items():
        row = dict(model_shape=shape, placement=placement, gpus=gpus, spec_mode=mode, batch=batch, k=K,
                   backend=f"hf_specdec_{placement}", tokens_per_s=None, speedup_vs_plain=None,
                   speedup_vs_single_gpu=None, same_tokens=None, skipped=None)
        if isinstance(measured, str):
            rows.append(row | dict(skipped=measured))
            continue
        got = measured[(mode, batch)]
        plain = measured[("none", batch)]["tokens_per_s"] if ("none", batch) in measured else None
        same = got["output"] == base["output"] if base.get("output") is not None else None
        rows.append(row | dict(tokens_per_s=got["tokens_per_s"], same_tokens=same,
                               speedup_vs_plain=got["tokens_per_s"] / plain if plain else None,
                               speedup_vs_single_gpu=got["tokens_per_s"] / base["tokens_per_s"]))
    return rows


# ---------------------------------------------------------------- tensor parallel: one process per rank


def _tensor_parallel(shape: str, modes: list[str], args, **shape_settings) -> dict | str:
    """Spawn ``--gpus`` ranks (torchrun's environment, set by hand) that load ``shape`` with tp_plan (a shape: from
    ``shape_settings["folder"]``) and measure every mode; rank 0's measurements come back through a file."""
    import torch.multiprocessing as mp

    cuda = args.device.startswith("cuda")
    world = args.gpus if cuda else 2
    with tempfile.TemporaryDirectory() as folder:
        settings = dict(shape=shape, modes=modes, batch=args.batch, new_tokens=args.new_tokens, repeats=args.repeats,
                        cuda=cuda,
                        out=os.path.join(folder, "rank0.json"), **shape_settings)
        # gloo ranks on the CPU have aborted now and then right after loading (SIGABRT, "terminate called without
        # an active exception" from a thread without Python frames; 3 runs in ~35 on a 2-core machine, cause not
        # found): there, a run whose rank died on SIGABRT runs again (CPU_ABORT_RERUNS times at most), saying so. GPU
        # runs never rerun
        reruns = 0 if cuda else CPU_ABORT_RERUNS
        for attempt in range(1 + reruns):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            try:
                mp.start_processes(_tp_rank, args=(world, port, settings), nprocs=world, join=True,
                                   start_method="spawn")
                break
            except mp.ProcessExitedException as error:
                if attempt == reruns or error.signal_name != "SIGABRT":
                    raise
                print(f"[multi_gpu] a gloo rank aborted ({error}); running the ranks again", file=sys.stderr)
        with open(settings["out"]) as f:
            return {(r["mode"], r["batch"]): r for r in json.load(f)}


def _tp_rank(rank: int, world: int, port: int, settings: dict) -> None:
    import faulthandler
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    # A rank that dies on a signal (once, on a loaded CPU: "terminate called without an active exception" in the
    # tiny-step3p5 gloo run) prints every thread's Python stack first.
    faulthandler.enable(all_threads=True)

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not settings["cuda"]:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: transformers would place rank r on cuda:r
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if settings["cuda"] else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        if "folder" in settings:  # a random-weight shape, written by the parent process
            model = _load_tp(settings["folder"], world, settings["replicate_attention"],
                             getattr(torch, settings["dtype"]))
            measured = _measure_shape(model, settings)
        else:
            model = _load_tp(_asset(settings["shape"]), world, settings["shape"] == "tiny-gemma4", torch.float32)
            args = SimpleNamespace(batch=settings["batch"], new_tokens=settings["new_tokens"],
                                   repeats=settings["repeats"])
            measured = _measure_all(model, settings["shape"], settings["modes"], args)
        if rank == 0:
            with open(settings["out"], "w") as f:
                json.dump([dict(mode=m, batch=b, **v) for (m, b), v in measured.items()], f)
    finally:
        dist.destroy_process_group()


def _load_tp(path: str, world: int, replicate_attention: bool, dtype: torch.dtype):
    """``tp_plan="auto"``, or with the attention replicated where a layer's KV heads do not split over ``world``
    ranks (the tiny Gemma 4's full layers have one)."""
    import transformers
    from transformers.distributed import DistributedConfig

    import hf_specdec
    from hf_specdec.runtime.distributed import replicated_attention_plan

    kwargs = dict(tp_plan="auto")
    if replicate_attention:
        plan = replicated_attention_plan(transformers.Gemma4ForCausalLM)
        kwargs = dict(distributed_config=DistributedConfig(tp_size=world, tp_plan=plan))
    model = hf_specdec.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.generation_config.eos_token_id = None
    return model


# ---------------------------------------------------------------- a random-weight Gemma 4 shape


def _shape_rows(args, progress) -> list[dict]:
    """``--shape``: plain and synthetic-acceptance MTP rows of a random-weight target on one device, split by a
    balanced device map, and under tensor parallelism."""
    from benchmarks.shapes import STEP3P5, shape_name, target_for

    if args.shape in STEP3P5:
        raise SystemExit("multi_gpu --shape takes a Gemma 4 shape; Step 3.5 runs as the bundled tiny-step3p5")
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    home = "cuda:0" if cuda else args.device
    modes = [m for m in args.modes if m in ("none", "mtp")]
    settings = dict(layers=args.layers, alpha=args.alpha, prompt=args.prompt, dtype=str(dtype).split(".")[-1])
    progress.total(1 + len(args.placements))
    target = target_for(args.shape, args.layers, home, dtype)
    with tempfile.TemporaryDirectory() as folder:
        if "tp" in args.placements:  # before enable: it stacks projections into shared storages
            target.save_pretrained(folder)
        run_settings = dict(settings, shape=args.shape, modes=modes, batch=args.batch, new_tokens=args.new_tokens,
                            repeats=args.repeats)
        single = _measure_shape(target, run_settings, enable=True)
        progress.step("one device")
        measured = {}
        for placement in args.placements:
            if placement == "offload":
                measured[placement] = "offload rows run on the bundled tiny family (--shape tiny)"
            elif placement == "device_map":
                gpus = torch.cuda.device_count() if cuda else 0
                if gpus < max(2, args.gpus):
                    measured[placement] = f"device_map needs {max(2, args.gpus)} GPUs, {gpus} present"
                else:
                    _dispatch_balanced(target, args.gpus, dtype)
                    measured[placement] = _measure_shape(target, run_settings, enable=True)
            progress.step(placement)
        kv_heads = {layer.self_attn.k_proj.out_features // layer.self_attn.head_dim for layer in target.model.layers}
        del target
        free_device_memory()
        if "tp" in args.placements:
            gpus = torch.cuda.device_count() if cuda else 2
            world = args.gpus if cuda else 2
            replicate = any(heads % world for heads in kv_heads)
            measured["tp"] = (f"tp needs {args.gpus} GPUs, {gpus} present" if gpus < args.gpus else
                              _tensor_parallel(args.shape, modes, args, folder=folder,
                                               replicate_attention=replicate, **settings))
            progress.step("tp")
    name = shape_name(args.shape, args.layers)
    rows = []
    measured["single"] = single
    for placement in ["single", *args.placements]:
        for row in _rows(name, placement, measured[placement], single, args):
            rows.append(row | dict(dtype=settings["dtype"], alpha=args.alpha if row["spec_mode"] == "mtp" else None,
                                   prompt=args.prompt))
    return rows


def _dispatch_balanced(model, gpus: int, dtype: torch.dtype) -> None:
    """Place ``model`` over ``gpus`` GPUs as ``from_pretrained(device_map="balanced")`` does (accelerate's balanced
    memory, then its device map and hooks)."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = model._no_split_modules
    memory = get_balanced_memory(model, max_memory={i: torch.cuda.mem_get_info(i)[0] for i in range(gpus)},
                                 no_split_module_classes=no_split, dtype=dtype)
    device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split, dtype=dtype)
    dispatch_model(model, device_map=device_map)


def _measure_shape(model, settings: dict, enable: bool = False) -> dict:
    """{(mode, batch): tokens/s (and plain decoding's tokens)} of an (enabled, or enabled here) random-weight
    target: plain, and MTP with its assistant at synthetic acceptance ``settings["alpha"]``, k = :data:`K`."""
    import hf_specdec
    from benchmarks.drafters import SyntheticAcceptance
    from benchmarks.shapes import gemma4_assistant, random_prompt
    from hf_specdec.generation.registry import build_drafter
    from hf_specdec.runtime.placement import input_device

    model.generation_config.eos_token_id = None  # random weights: every row runs the full length
    model.generation_config.pad_token_id = 0
    if enable:
        hf_specdec.enable(model)
    device = str(input_device(model))
    out = {}
    try:
        for mode in settings["modes"]:
            if mode == "timeline":  # benchmarks/step_timeline.py: every rank profiles the same plain call
                from benchmarks.step_timeline import _profile, timeline

                for batch in settings["batch"]:
                    ids = random_prompt(batch, settings["prompt"], model.config.vocab_size, device)
                    out[(mode, batch)] = dict(timeline=timeline(_profile(model, ids, settings["new_tokens"], None)))
                continue
            extra = {}
            if mode == "mtp":  # seeded: every rank of a tensor-parallel group builds the same assistant
                assistant = gemma4_assistant(settings["shape"], model, device, getattr(torch, settings["dtype"]))
                extra = dict(assistant_model=build_drafter(model, assistant, "mtp", K),
                             acceptance=SyntheticAcceptance(settings["alpha"]))
            for batch in settings["batch"]:
                ids = random_prompt(batch, settings["prompt"], model.config.vocab_size, device)
                measured = decode_rate(lambda n: model.generate(ids, attention_mask=torch.ones_like(ids),
                                                                max_new_tokens=n, do_sample=False, **extra),
                                       batch, settings["new_tokens"], repeats=settings.get("repeats", 1))
                out[(mode, batch)] = dict(tokens_per_s=measured["tokens_per_s"], output=(
                    measured["output"].cpu().tolist() if mode == "none" else None))
    finally:
        if enable:
            hf_specdec.disable(model)
    return out


main = bench_main(__import__(__name__, fromlist=["NAME"]))

if __name__ == "__main__":
    raise SystemExit(main())
