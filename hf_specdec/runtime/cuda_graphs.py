"""CUDA graphs for the target's decode and verify forwards.

A decode (1 token per row) or verify (k+1 tokens per row) forward has the same shapes at every step of a
request, so after running it once eagerly the runner captures it into a CUDA graph over static buffers:
the token ids, the plan's per-row counts and block tables (padded to the widest table the request can
reach), and the whole :class:`ForwardMeta` (positions, slot mappings, key lengths) that the graph derives from
them at its start. Each later step copies the new ids and counts (and the tables, when a block was allocated or
released) into those buffers and replays the graph: one launch instead of the model's hundreds of kernel
launches and Python calls. The Triton kernels read every length from device memory and size their grids from shapes
alone, and ``PagedKVCache.update`` writes K/V by slot mapping, so a replay does exactly what an eager
forward with the same inputs does (same tokens as eager, with and without graphs).

Forward hooks (a drafter recording hidden states) run only while capturing; what they recorded then are
tensors inside the graph's memory, rewritten by each replay, so after a replay the runner puts them back
where the drafter looks (``HookedState``).

Graphs are captured per batch bucket (:func:`batch_bucket`: 1, 2, 4, then multiples of 8): a batch of 5
replays the graph of 8 with three padding rows, which have no query tokens, no slot (their K/V are not
stored), no keys and no pages; the logits and hook records of the real rows are returned. After a larger
batch replayed a graph, the rows past a smaller one are reset to padding before its replay, so no stale
slot mapping writes into pages a later request owns.

Graphs are kept per enabled model (:class:`GraphStore`) with the K/V storage they write into, so later
requests of the same batch bucket and k replay them without capturing: the storage is pooled (allocated
once, grown when a request needs more, released by ``hf_specdec.disable``). Each kept graph holds its own
memory pool (its activations and logits), so the store keeps at most ``max_graphs`` of them and drops the
least recently used one first (``hf_specdec.enable(model, max_cuda_graphs=...)``). A forward that cannot be
captured (a model doing host work inside its forward) falls back to eager, with one warning saying why.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from hf_specdec.cache import ForwardMeta, ForwardPlan
from hf_specdec.cache.paged_cache import StaticPlan

CUDA_GRAPHS_ENV = "HF_SPECDEC_CUDA_GRAPHS"
MAX_GRAPH_QUERY_LEN = 32  # decode and verify forwards; prefills run eagerly
DEFAULT_MAX_GRAPHS = 64  # kept graphs per model (forwards and drafter calls together)
# a graph derives its forward's metadata (positions, slot mappings, key lengths, tables) itself, from static copies
# of the plan's counts and tables that a replay refreshes, instead of a launch of the derivation from the host per
# replay (False: the derivation launched from the host into the graph's static metadata, for A/B)
META_IN_GRAPH = True


def cuda_graphs_wanted(requested: bool, device: torch.device) -> bool:
    """Whether a request on ``device`` uses graphs: asked for, on CUDA, and not switched off by the env."""
    if os.environ.get(CUDA_GRAPHS_ENV) == "0":
        return False
    return requested and device.type == "cuda"


class HookedState:
    """What forward hooks of a drafter recorded (an object's attributes or a list's items), saved right
    after a capture and put back after every replay of that graph."""

    def __init__(self, holder, signature=None):
        self.holder = holder
        self.signature = signature  # what the hooks record (graphs captured with other hooks are not reused)

    def snapshot(self):
        if self.holder is None:
            return None
        if isinstance(self.holder, list):
            return list(self.holder)
        return dict(vars(self.holder))

    def restore(self, saved, rows: int | None = None) -> None:
        """Put ``saved`` back; with ``rows``, tensors recorded for a padded batch keep their first ``rows``."""
        if saved is None:
            return
        if rows is not None:
            saved = _first_rows(saved, rows)
        if isinstance(self.holder, list):
            self.holder[:] = saved
        else:
            vars(self.holder).update(saved)


def _first_rows(saved, rows: int):
    """``saved`` (a list or dict of records) with every tensor cut to its first ``rows`` rows."""
    cut = (lambda v: v[:rows] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] > rows else v)
    return [cut(v) for v in saved] if isinstance(saved, list) else {k: cut(v) for k, v in saved.items()}


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph | SpanningGraph"
    input_ids: torch.Tensor  # [bucket, q_len]
    meta: ForwardMeta  # bucket rows, rebuilt in place by each replay (rows past the batch are padding)
    logits: torch.Tensor
    hooked: object
    selected: tuple = ()  # what the forward's ``select`` computed from its ids and logits (in the graph too)
    plan: StaticPlan | None = None  # the counts and tables the graph derives ``meta`` from (META_IN_GRAPH)


def batch_bucket(batch: int) -> int:
    """The batch size a graph is captured for: 1, 2 or 4 for small batches, else the next multiple of 8, so
    requests of nearby batch sizes (and a request whose prompts were split differently) share graphs."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return 1 << (batch - 1).bit_length() if batch <= 4 else -(-batch // 8) * 8


class GraphStore:
    """What an enabled model keeps between ``generate`` calls to replay graphs: one pooled K/V storage per
    KV group (a graph writes into the storage it was captured with, so requests reuse it), the captured
    target forwards and drafter calls (each graph with its own memory pool: graphs sharing one could
    overwrite each other's live outputs). Growing the storage drops every graph
    (they point into the old one), and so does a weight of the models they run moving to other memory
    (:meth:`check_weights`). Lives in ``model._hf_specdec``; ``hf_specdec.disable`` releases it."""

    def __init__(self, max_graphs: int = DEFAULT_MAX_GRAPHS):
        self.generation = 0
        self.storages: dict[str, tuple] = {}  # per owner ("target", a drafter's cache): (key, blocks, k, v)
        self.graphs: dict[tuple, _Graph] = {}
        self.calls: dict[tuple, CallGraph] = {}
        self.max_graphs = check_max_graphs(max_graphs)
        self.evicted = 0  # graphs dropped to stay within max_graphs
        self._recency: OrderedDict[tuple[str, tuple], None] = OrderedDict()  # (table, key), least recent first
        self.disabled_reason: str | None = None
        # the GPUs a model accelerate placed over several of them runs on: its graphs span them (SpanningGraph)
        self.devices: tuple[torch.device, ...] = ()
        # where the weights the graphs read were, per model (check_weights): id -> (weak reference, addresses)
        self.weights: dict[int, tuple] = {}

    def get(self, table: str, key: tuple):
        """The kept graph ``key`` of ``table`` ("graphs": target forwards, "calls": drafter calls), or None;
        a hit counts as a use."""
        found = getattr(self, table).get(key)
        if found is not None:
            self._recency.move_to_end((table, key))
        return found

    def keep(self, table: str, key: tuple, graph) -> None:
        """Keep ``graph`` under ``key``; beyond ``max_graphs`` the least recently used graph is dropped (its
        memory pool is freed once nothing reads its outputs any more)."""
        getattr(self, table)[key] = graph
        self._recency[(table, key)] = None
        self._recency.move_to_end((table, key))
        self.trim()

    def trim(self) -> None:
        """Drop least recently used graphs until at most ``max_graphs`` are kept."""
        while len(self._recency) > self.max_graphs:
            (old_table, old_key), _ = self._recency.popitem(last=False)
            del getattr(self, old_table)[old_key]
            self.evicted += 1

    def check_weights(self, *models: torch.nn.Module) -> None:
        """Drop every graph when a weight or buffer of ``models`` (a request's target and its drafter's model) lies
        elsewhere than when they were captured: a graph replays the addresses it was captured with, so weights
        replaced since (``model.cpu().cuda()``, ``.half().float()``, ``param.data = ...``,
        ``load_state_dict(assign=True)``) would be read from freed memory. Weights changed in place (an optimizer
        step, ``load_state_dict`` without ``assign``) stay where they were: the graphs read their new values."""
        moved = False
        for model in dict.fromkeys(models):
            where = _addresses(model)
            known = self.weights.get(id(model))
            if known is not None and (known[0]() is not model or known[1] != where):
                moved = True  # (another model under a reused id counts as moved)
            self.weights[id(model)] = (weakref.ref(model), where)
        if moved:
            self._drop_graphs()

    @property
    def storage(self):
        """The target's pooled storage (key, blocks per group, k list, v list), or None."""
        return self.storages.get("target")

    def take_storage(self, layout, need: list[int], block_size: int, dtype, device, allocate, owner: str = "target",
                     round_up: bool = True):
        """(k list, v list, blocks per group) with at least ``need[g]`` blocks each for ``owner`` (the target's
        cache, or a drafter's own): its pooled storage if it fits, else a new one from ``allocate(blocks)``
        (power-of-two block counts with ``round_up``, so growth is rare). A new storage drops every graph (they
        may write into the old one); the other owners' storage stays pooled."""
        key = (_layout_key(layout), block_size, dtype, torch.device(device))
        pooled = self.storages.get(owner)
        if pooled is not None and pooled[0] == key and all(n <= have for n, have in zip(need, pooled[1])):
            return pooled[2], pooled[3], pooled[1]
        self.storages.pop(owner, None)  # freed with its graphs, before the new one is allocated
        self._drop_graphs()
        blocks = [1 << max(0, n - 1).bit_length() for n in need] if round_up else list(need)
        try:
            k, v = allocate(blocks)
        except (torch.OutOfMemoryError, ValueError):
            blocks = list(need)  # the rounded-up size does not fit: exactly what this request needs
            k, v = allocate(blocks)
        self.storages[owner] = (key, blocks, k, v)
        return k, v, blocks

    def release(self) -> None:
        """Drop every storage and every graph (the next request allocates and captures anew)."""
        self.storages.clear()
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        self.graphs.clear()
        self.calls.clear()
        self._recency.clear()
        self.generation += 1


def _addresses(model: torch.nn.Module) -> tuple:
    """Where each parameter and buffer of ``model`` is: (address, shape) per tensor, through a tensor subclass's inner
    tensors (quantized weights, a DTensor's shard)."""
    return tuple(_where(t) for module in model.modules() for tensors in (module._parameters, module._buffers)
                 for t in tensors.values() if t is not None)


def _where(tensor: torch.Tensor):
    if is_traceable_wrapper_subclass(tensor):  # (its data_ptr() is 0, or raises): where its inner tensors are
        return tuple(_where(inner) for inner in (getattr(tensor, name) for name in tensor.__tensor_flatten__()[0])
                     if inner is not None)
    try:
        return tensor.data_ptr(), tensor.shape
    except RuntimeError:  # another tensor without storage of its own
        return id(tensor), tensor.shape


def _layout_key(layout) -> tuple:
    """What makes two KV layouts' storage interchangeable: their groups' shapes (a drafter builds its layout
    anew per request)."""
    groups = getattr(layout, "groups", None)
    if groups is None:
        return (id(layout),)
    return tuple((g.num_kv_heads, g.head_dim, len(g.layers)) for g in groups)


def check_max_graphs(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_cuda_graphs must be an int >= 1 (a request keeps up to 3: decode, verify and the "
                         f"drafter's steps; 8 or more avoids recapturing), got {value!r}.")
    return value


class GraphRunner:
    """Captures and replays an enabled model's fixed-shape forwards over one request's PagedKVCache, keeping
    the graphs in the model's :class:`GraphStore` for later requests."""

    def __init__(self, model, store: GraphStore, cache, table_width: int, hooked: HookedState):
        self.model = model
        self.store = store
        self.cache = cache
        self.table_width = table_width
        self.hooked = hooked

    def key(self, input_ids: torch.Tensor, keep_logits: int, select=None) -> tuple:
        batch, q_len = input_ids.shape
        return (self.store.generation, (batch_bucket(batch), q_len), keep_logits, self.table_width,
                self.hooked.signature, None if select is None else select.name, META_IN_GRAPH)

    def can_run(self, input_ids: torch.Tensor, extra: dict) -> bool:
        return self.store.disabled_reason is None and not extra and input_ids.shape[1] <= MAX_GRAPH_QUERY_LEN

    def has(self, key: tuple) -> bool:
        return key in self.store.graphs

    def replay(self, key: tuple, input_ids: torch.Tensor, plan: ForwardPlan):
        """(outputs, metadata of the real rows) of the graph ``key`` replayed for ``input_ids`` and ``plan``: the
        ids are copied into its first rows and the plan's counts and tables into its static ones, from which the
        graph derives the metadata (rows past the batch become padding: no query, no key, no slot, no page)."""
        g = self.store.get("graphs", key)
        rows = input_ids.shape[0]
        g.input_ids[:rows].copy_(input_ids)
        if g.plan is not None:
            g.plan.load(plan)
        else:
            plan.meta(out=g.meta)
        g.graph.replay()
        self.hooked.restore(g.hooked, rows)
        return SimpleNamespace(logits=g.logits[:rows], selected=tuple(t[:rows] for t in g.selected)), g.meta.rows(rows)

    def capture(self, key: tuple, input_ids: torch.Tensor, plan: ForwardPlan, forward) -> None:
        """Capture ``forward(input_ids)`` for ``key`` over static metadata derived from ``plan`` (after it ran
        eagerly with the same inputs, so a warm-up replay rewrites the same K/V into the same slots). On failure,
        graphs are off for the model."""
        rows, bucket = input_ids.shape[0], key[1][0]
        static_ids = torch.nn.functional.pad(input_ids, (0, 0, 0, bucket - rows))  # padding rows: token 0
        static_meta = plan.meta(rows=bucket, width=self.table_width)
        static_plan = None
        if META_IN_GRAPH:
            static_plan = StaticPlan(*StaticPlan.inputs_for(plan, bucket, self.table_width), plan.q_len,
                                     plan.block_size, static_meta)
        recorded = self.hooked.snapshot()  # the eager forward's records: what the caller reads next
        body = _derive_then(static_plan, forward)

        def run(ids):  # each run (the warm-up, the capture) a forward of its own: per-GPU copies of the metadata
            with self.cache.forward_with(static_meta):  # made inside it (PagedKVCache.meta_on) are captured
                return body(ids)
        try:
            graph, out = capture_graph(run, static_ids, devices=self.store.devices)
            self.store.keep("graphs", key, _Graph(graph, static_ids, static_meta, out.logits, self.hooked.snapshot(),
                                                  getattr(out, "selected", ()), static_plan))
        except Exception as error:  # noqa: BLE001 - any capture failure means: run eagerly
            self.store.disabled_reason = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"hf_specdec could not capture a CUDA graph of {type(self.model).__name__}'s forward "
                f"({self.store.disabled_reason}); decoding eagerly. Pass cuda_graphs=False to hf_specdec.enable "
                "to skip the attempt.", RuntimeWarning, stacklevel=3,
            )
        finally:
            self.hooked.restore(recorded)


def _derive_then(static_plan: StaticPlan | None, forward):
    """``forward`` preceded by the derivation of its metadata from ``static_plan`` (when there is one)."""
    if static_plan is None:
        return forward

    def body(*inputs):
        static_plan.derive()
        return forward(*inputs)
    return body


def capture_graph(fn, *inputs, devices: tuple = ()):
    """(graph, outputs) of ``fn(*inputs)`` captured as a CUDA graph with its own memory pool (a pool shared
    with other graphs could overlay their live outputs), after one warm-up run on a side stream (lazy
    initialisations must not be captured). ``devices``: the GPUs ``fn``'s work runs on (a model accelerate placed
    over several GPUs): the graph then spans them (:class:`SpanningGraph`)."""
    here = torch.cuda.current_device()
    others = tuple(d for d in devices if torch.device(d).index != here)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    try:
        if others:
            return SpanningGraph.capture(fn, inputs, others)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):  # (its default stream is on the GPU first current)
            outputs = fn(*inputs)
        return graph, outputs
    except BaseException:
        _end_generator_capture(here)
        raise


def _end_generator_capture(index: int) -> None:
    """Take GPU ``index``'s default random generator out of capture mode after a capture that failed: torch marks
    its state capturing when a capture begins and unmarks it only when a capture ends well, so every random op after
    a failed one (the sampling of the eager decoding that follows) raised "Offset increment outside graph capture".
    A capture of nothing that ends well unmarks that same state object, which the graphs captured before share (a
    fresh state would leave them on the marked one, out of reach of ``manual_seed``); harmless where nothing was
    marked."""
    with torch.cuda.device(index):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            torch.empty(1, device=torch.device("cuda", index)).zero_()  # (torch warns of an empty graph)


class SpanningGraph:
    """A CUDA graph whose work runs on several GPUs: a forward of a model accelerate placed over them, its layers'
    kernels on their own GPU (their hooks make it the current device) and the activations copied between them.

    Captured from the current GPU's stream: each other GPU's current stream is a side stream that joins the capture
    (it waits on an event of the capturing stream) and is joined back at its end, so the kernels and copies that
    run there become nodes of the same graph; their memory comes from a pool of that GPU's own
    (``torch.cuda.MemPool``, kept with the graph, as the graph's pool is on the capturing GPU). A replay is one
    launch on the current GPU's stream; it first waits for the work queued on the other GPUs' current streams, and
    their streams wait for it, so eager work there (a prompt's forward) and replays stay in order."""

    def __init__(self, graph, here: int, devices: tuple, pools: list):
        self.graph, self.here, self.devices, self.pools = graph, here, devices, pools

    @classmethod
    def capture(cls, fn, inputs, devices: tuple):
        here = torch.cuda.current_device()
        devices = tuple(torch.device(d) for d in devices)
        for device in (here, *devices):
            torch.cuda.synchronize(device)
        pools = []
        for device in devices:
            with torch.cuda.device(device):
                pools.append(torch.cuda.MemPool())
        before = [torch.cuda.current_stream(d) for d in devices]
        sides = [torch.cuda.Stream(d) for d in devices]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(here)):
                main = torch.cuda.current_stream()
                for side in sides:
                    side.wait_stream(main)  # the side stream joins the capture
                    torch.cuda.set_stream(side)  # (it makes the side's GPU current: set back below)
                torch.cuda.set_device(here)
                with contextlib.ExitStack() as stack:
                    for device, pool in zip(devices, pools):
                        stack.enter_context(torch.cuda.use_mem_pool(pool, device=device))
                    outputs = fn(*inputs)
                for side in sides:
                    main.wait_stream(side)  # joined back: a capture ends with every forked stream joined
        finally:  # also where the capture failed (the caller then runs eagerly on these GPUs' own streams)
            for previous in before:
                torch.cuda.set_stream(previous)
            torch.cuda.set_device(here)
        return cls(graph, here, devices, pools), outputs

    def replay(self) -> None:
        """One launch on the capturing GPU's current stream (where ``CUDAGraph.replay`` launches, whichever GPU is
        current), in order with the work queued on the other GPUs' current streams both ways."""
        main = torch.cuda.current_stream(self.here)
        for device in self.devices:
            main.wait_stream(torch.cuda.current_stream(device))
        self.graph.replay()
        for device in self.devices:
            torch.cuda.current_stream(device).wait_stream(main)


def table_width_bucket(blocks: int) -> int:
    """Block-table width a graph is captured for: a power of two >= 8, so requests of similar lengths share."""
    return max(8, 1 << max(0, blocks - 1).bit_length())


class CallGraph:
    """A function of fixed-shape device tensors, captured once and replayed: ``graph(*inputs)`` copies the
    inputs into the static ones it was captured with and returns the (static) outputs. A drafter uses it
    for its whole propose (k draft steps in one replay). ``fn`` must not sync with the host."""

    def __init__(self, fn, inputs: list[torch.Tensor], devices: tuple = ()):
        self.inputs = [t.clone() for t in inputs]
        self.graph, self.outputs = capture_graph(fn, *self.inputs, devices=devices)
        # the forwards it derives its metadata for, over its inputs (drafter_graphs: a replay loads each plan)
        self.plans: list[StaticPlan] = []

    def __call__(self, *inputs: torch.Tensor):
        """Replay with ``inputs``; inputs with fewer rows than the captured ones (a smaller batch of the same
        bucket) fill the first rows, and the other rows keep what they held (the caller reads its rows)."""
        for static, new in zip(self.inputs, inputs):
            (static if new.shape == static.shape else static[:new.shape[0]]).copy_(new)
        self.graph.replay()
        return self.outputs


def pad_rows(tensor: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    """``tensor`` [batch, ...] padded with ``value`` to ``rows`` rows (itself when it has them)."""
    extra = rows - tensor.shape[0]
    if extra <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_full((extra, *tensor.shape[1:]), value)])


def pad_table(table: torch.Tensor, width: int) -> torch.Tensor:
    """A [batch, w] block table padded with -1 (no block) to [batch, width]."""
    if table.shape[1] >= width:
        return table
    return torch.nn.functional.pad(table, (0, width - table.shape[1]), value=-1)


META_INPUTS = 6  # tensors of a ForwardMeta as a graph's flat inputs (meta_inputs)


def meta_inputs(meta: ForwardMeta) -> list[torch.Tensor]:
    """``meta`` (built on the device, e.g. by ``ForwardPlan.meta`` at a graph's bucket and table width) as a drafter
    graph's flat inputs; :func:`meta_of_inputs` inverts it."""
    b = meta.buffers
    return [b["kv_lens"], b["q_pos0"], b["q_lens"], b["positions"], b["slots"], b["tables"]]


def meta_of_inputs(inputs, q_len: int) -> ForwardMeta:
    """The ForwardMeta over a graph's flat inputs from :func:`meta_inputs` (its tensors, not copies)."""
    kv_lens, q_pos0, q_lens, positions, slots, tables = inputs
    return ForwardMeta.over(q_len, dict(kv_lens=kv_lens, q_pos0=q_pos0, q_lens=q_lens, positions=positions,
                                        slots=slots, tables=tables))
