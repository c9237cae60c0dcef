"""multi_gpu: hf_specdec over several devices — accelerate device_map, offload, transformers tensor parallelism.

    python -m benchmarks.multi_gpu [--gpus 2] [--placements device_map tp offload] [--modes none mtp dflash]
                                   [--batch 1 4] [--new-tokens 32] [--quick | --smoke]

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
"""

from __future__ import annotations

import json
import os
import socket
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


def add_arguments(parser) -> None:
    parser.add_argument("--gpus", type=int, default=max(2, torch.cuda.device_count()),
                        help="GPUs for device_map and tp rows (tp on the CPU: this many gloo ranks)")
    parser.add_argument("--placements", nargs="+", default=["device_map", "tp", "offload"],
                        choices=["device_map", "tp", "offload"])
    parser.add_argument("--modes", nargs="+", default=["none", "mtp", "dflash"], choices=["none", "mtp", "dflash"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=32)


def run(args, progress) -> list[dict]:
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


def _modules(shape: str) -> tuple[list[str], int]:
    """(the top-level module names of a model of this shape, apart from its layers; its layer count)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(_asset(shape))
    text = config.get_text_config()
    extra = ["model.rotary_emb", "model.embed_tokens", "model.norm", "lm_head"]
    if shape == "tiny-gemma4":
        extra += ["model.embed_tokens_per_layer", "model.per_layer_model_projection", "model.per_layer_projection_norm"]
    layers = text.num_hidden_layers + (getattr(text, "num_nextn_predict_layers", 0) or 0)
    return extra, layers


def _split_map(shape: str, args, devices: list[str]) -> dict[str, str]:
    """Layers split evenly over ``devices``; embedding on the first, norm and head on the last."""
    extra, layers = _modules(shape)
    placement = {name: devices[0] for name in extra}
    placement.update({"model.norm": devices[-1], "lm_head": devices[-1]} if shape != "tiny-gemma4" else {})
    placement.update({f"model.layers.{i}": devices[i * len(devices) // layers] for i in range(layers)})
    return placement


def _offload_map(shape: str, args, elsewhere: str) -> dict[str, str]:
    """Odd layers ``elsewhere`` ("cpu" memory on a GPU, "disk" on the CPU), the rest on the device; on the CPU the
    embedding, final norm and (tied) LM head too."""
    extra, layers = _modules(shape)
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
                                                            do_sample=False, **extra), batch, args.new_tokens)
            out[(mode, batch)] = dict(tokens_per_s=measured["tokens_per_s"], output=measured["output"].cpu().tolist())
    return out


def _rows(shape: str, placement: str, measured, single: dict, args) -> list[dict]:
    gpus = {"device_map": args.gpus, "tp": args.gpus, "offload": 1}[placement]
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
        rows.append(row | dict(tokens_per_s=got["tokens_per_s"], same_tokens=got["output"] == base["output"],
                               speedup_vs_plain=got["tokens_per_s"] / plain if plain else None,
                               speedup_vs_single_gpu=got["tokens_per_s"] / base["tokens_per_s"]))
    return rows


# ---------------------------------------------------------------- tensor parallel: one process per rank


def _tensor_parallel(shape: str, modes: list[str], args) -> dict | str:
    """Spawn ``--gpus`` ranks (torchrun's environment, set by hand) that load ``shape`` with tp_plan and measure
    every mode; rank 0's measurements come back through a file."""
    import torch.multiprocessing as mp

    world = args.gpus if args.device.startswith("cuda") else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        settings = dict(shape=shape, modes=modes, batch=args.batch, new_tokens=args.new_tokens,
                        cuda=args.device.startswith("cuda"), out=os.path.join(folder, "rank0.json"))
        mp.start_processes(_tp_rank, args=(world, port, settings), nprocs=world, join=True, start_method="spawn")
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
        model = _load_tp(settings["shape"], world)
        args = SimpleNamespace(batch=settings["batch"], new_tokens=settings["new_tokens"])
        measured = _measure_all(model, settings["shape"], settings["modes"], args)
        if rank == 0:
            with open(settings["out"], "w") as f:
                json.dump([dict(mode=m, batch=b, **v) for (m, b), v in measured.items()], f)
    finally:
        dist.destroy_process_group()


def _load_tp(shape: str, world: int):
    """``tp_plan="auto"``; the tiny Gemma 4 with its attention replicated (one full-layer KV head does not split)."""
    import transformers
    from transformers.distributed import DistributedConfig

    import hf_specdec
    from hf_specdec.runtime.distributed import replicated_attention_plan

    kwargs = dict(tp_plan="auto")
    if shape == "tiny-gemma4":
        plan = replicated_attention_plan(transformers.Gemma4ForCausalLM)
        kwargs = dict(distributed_config=DistributedConfig(tp_size=world, tp_plan=plan))
    model = hf_specdec.AutoModelForCausalLM.from_pretrained(_asset(shape), dtype=torch.float32, **kwargs)
    model.generation_config.eos_token_id = None
    return model


main = bench_main(__import__(__name__, fromlist=["NAME"]))

if __name__ == "__main__":
    raise SystemExit(main())
