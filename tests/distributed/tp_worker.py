"""One rank of the tensor-parallel tests: joins a gloo group on the loopback address, loads the tiny models with
their tp_plan, runs every case of ``tp_cases`` and writes what it generated, its KV layouts and the errors of the
refused placements to ``out_dir/rank{rank}.json`` (a traceback under "failure" if it failed)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import time
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

GROUP_TIMEOUT_S = 90  # a rank left waiting in a collective fails instead of hanging the test
WORLD_SIZE = 2
TIMEOUT_S = 240  # both ranks together; a hung collective fails sooner (GROUP_TIMEOUT_S)


def main(rank: int, world_size: int, port: int, gemma_dirs: dict[str, str], out_dir: str,
         backend: str = "gloo", options: dict | None = None) -> None:
    """``backend`` "gloo": CPU ranks; "nccl": rank r on cuda:r (each target's graphs counted; the process group is
    destroyed under them, as a user's script does it). ``options``: "env" (set before hf_specdec is imported),
    "cases" (names: only those, and nothing else), "max_new_tokens"."""
    options = options or {}
    # only where the options say (a rank inherits the parent's)
    for name in ("HF_SPECDEC_TP_FUSED", "HF_SPECDEC_TP_SYMM_ALL_REDUCE", "HF_SPECDEC_TP_PEER_SUM"):
        os.environ.pop(name, None)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      **options.get("env", {}))
    if backend == "gloo":
        # CPU ranks even on a GPU machine (before anything initialises CUDA): with a GPU visible transformers would
        # place rank r on cuda:r, which a one-GPU machine does not have
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    _quiet()
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    result = {}
    try:
        from tests.distributed import tp_cases

        dirs = {name: pathlib.Path(path) for name, path in gemma_dirs.items()}
        tp_cases.MAX_NEW_TOKENS = options.get("max_new_tokens", tp_cases.MAX_NEW_TOKENS)
        if "cases" in options:
            chosen = [case for case in tp_cases.CASES if case.name in options["cases"]]
            result["cases"] = {case.name: tp_cases.run_case(case, dirs, tp=True) for case in chosen}
            targets = {case.name: tp_cases.target_of(case.family, dirs, tp=True) for case in chosen}
            result["fused_modules"] = {name: fused_modules(t) for name, t in targets.items()}
            result["sharded_projections"] = {name: sharded_projections(t) for name, t in targets.items()}
            return
        if backend == "nccl":
            result["cases"] = tp_cases.run_cases(dirs, tp=True, device=f"cuda:{rank}")
            targets = {family: tp_cases.target_of(family, dirs, tp=True)
                       for family in ("gemma", "step", "gemma_replicated_attention")}
            result["graphs"] = {family: len(t._hf_specdec.graph_store.graphs) for family, t in targets.items()}
            result["fused_modules"] = {family: fused_modules(t) for family, t in targets.items()}
            result["sharded_projections"] = {family: sharded_projections(t) for family, t in targets.items()}
            return
        result["cases"] = tp_cases.run_cases(dirs, tp=True)
        result["kv_heads"] = tp_cases.kv_heads(dirs, tp=True)
        result["errors"] = refused_placements(dirs)
    except BaseException:
        result["failure"] = traceback.format_exc()
        raise
    finally:
        pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def fused_modules(model) -> int:
    """How many modules of ``model`` run hf_specdec's fused forward."""
    from hf_specdec.generation.fusion import _FUSED

    return sum(getattr(vars(m).get("forward"), "__func__", None) is _FUSED[type(m)].forward
               for m in model.modules() if type(m) in _FUSED)


def sharded_projections(model) -> dict[str, int]:
    """How many sharded projections of ``model`` run hf_specdec's forward on their shard ("forwards"), how many
    groups of column-parallel shards run as one GEMM ("stacked"), how many of the projections gather their outputs
    ("gathers": an LM head) and embeddings look up their vocabulary rows ("embeddings"), and how many symmetric-memory
    buffers this rank
    set up for the row-parallel sums ("symmetric": the one-shot all-reduce's, "peer": peer_sum's)."""
    from hf_specdec.generation.fusion import stacked_groups
    from hf_specdec.kernels.stacked_linear import stacked_weight
    from hf_specdec.runtime import distributed

    stacked = 0
    for module in model.modules():
        for names in stacked_groups(module):
            linears = [getattr(module, n) for n in names if getattr(module, n, None) is not None]
            stacked += all(distributed.TP_FORWARD in vars(m) for m in linears) and stacked_weight(*linears) is not None
    return dict(forwards=sum(distributed.TP_FORWARD in vars(m) for m in model.modules()), stacked=stacked,
                gathers=sum(vars(m).get(distributed.SHARD_KIND) == distributed.GATHER for m in model.modules()),
                embeddings=sum(isinstance(m, torch.nn.Embedding) and distributed.ROW_SHARD in vars(m)
                               for m in model.modules()),
                symmetric=sum(buffer is not None for buffer in distributed._SYMM_BUFFERS.values()),
                peer=sum(state is not None and state.calls > 0 for state in distributed._PEER_STATES.values()))


def refused_placements(gemma_dirs: dict[str, pathlib.Path]) -> dict[str, str]:
    """The messages of placements that cannot work (every rank raises alike, before any collective)."""
    import transformers
    from torch.distributed.tensor import Replicate, distribute_tensor

    import hf_specdec
    from hf_specdec.assets import asset_path
    from tests.distributed import tp_cases

    errors = {}
    # the bundled target with its own plan: its full layers have one KV head, which two ranks cannot split
    bundled = transformers.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"), dtype=torch.float32,
                                                                tp_plan="auto")
    try:
        hf_specdec.enable(bundled)
    except ValueError as error:
        errors["one_kv_head"] = str(error)
    # a drafter with sharded weights (here one weight placed as a DTensor on the target's mesh)
    target = tp_cases.target_of("gemma", gemma_dirs, tp=True)
    assistant = transformers.AutoModelForCausalLM.from_pretrained(gemma_dirs["assistant"], dtype=torch.float32)
    mesh = next(p for p in target.parameters() if hasattr(p, "device_mesh")).device_mesh
    weight = assistant.pre_projection.weight.detach()
    assistant.pre_projection.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Replicate()]))
    try:
        target.generate(torch.tensor([[2, 100, 200]]), max_new_tokens=2, assistant_model=assistant)
    except ValueError as error:
        errors["sharded_drafter"] = str(error)
    return errors


def _quiet() -> None:
    """Keep the test's output to what fails: no load progress bars or deprecation notes from every rank."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(gemma_dirs, out, backend: str, options: dict | None = None) -> list[dict]:
    """(The test process's side.) Run :func:`main` on WORLD_SIZE ranks of ``backend`` and return what each wrote;
    fails the test when a rank raised, died or did not finish within TIMEOUT_S."""
    args = (WORLD_SIZE, _free_port(), {name: str(path) for name, path in gemma_dirs.items()}, str(out), backend,
            options)
    context = mp.start_processes(main, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline, error = time.monotonic() + TIMEOUT_S, None
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                error = f"the {WORLD_SIZE} ranks did not finish within {TIMEOUT_S} s"
                break
    except ProcessException as exc:  # a rank raised or died: its traceback is in its file
        error = str(exc)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    written = [pathlib.Path(out, f"rank{r}.json") for r in range(WORLD_SIZE)]
    results = [json.loads(path.read_text()) if path.exists() else {} for path in written]
    failures = [r.get("failure") for r in results if r.get("failure")]
    if error or failures:
        pytest.fail(f"{error or 'a rank failed'}\n" + "\n".join(failures))
    return results
