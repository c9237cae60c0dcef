"""DrafterGraphs: the one place where a drafter's calls become CUDA graphs.

A drafter's fixed-shape work (Gemma 4 MTP draft steps, a DFlash block forward or context append, a Step 3.5
MTP layer's forward) is a function of device tensors. :meth:`DrafterGraphs.run` runs it eagerly the first
time, captures it into a :class:`CallGraph` of the batch's bucket (kept in the model's :class:`GraphStore`, so
later requests replay it too), and replays it afterwards; it pads the rows to the bucket, cuts the outputs
back to the real rows, and falls back to eager calls for the rest of the request when a capture fails (with
one warning). Off CUDA, or with graphs switched off, every call is eager.

Two kinds of call:

- a call that only reads (no forward metadata): a replay fills the first rows of the graph's inputs and the
  rows past a smaller batch keep an earlier call's inputs, which are read and dropped; the padding is built
  only for the capture;
- a call that writes K/V by slot mapping (``plan=``, a forward planned on ``cache``): its tensors are filled
  the same way, and its metadata is derived from the plan straight into the graph's static inputs for every
  row of the bucket (padding rows have no query, no key, no slot and no page), so rows a larger batch left
  never store anything; the function runs with that metadata as the cache's forward;
- a call of several such forwards (``plans=``: several caches, or one cache in forwards one after the other,
  e.g. a drafter's context append and its next block): the metadata of each, derived the same way, is handed to
  the function, which makes each its cache's forward where it runs it (``cache.forward_with``).
"""

from __future__ import annotations

import functools
import warnings

import torch

from hf_specdec.cache import ForwardPlan
from hf_specdec.cache.paged_cache import StaticPlan
from hf_specdec.runtime import cuda_graphs
from hf_specdec.runtime.cuda_graphs import (
    MAX_GRAPH_QUERY_LEN,
    META_INPUTS,
    CallGraph,
    GraphStore,
    batch_bucket,
    meta_inputs,
    meta_of_inputs,
    pad_rows,
)


class DrafterGraphs:
    """One drafter's CUDA graphs during one request. ``owner`` identifies what the graphs read besides their
    inputs (the drafter's weights, the target's embedding, ...): graphs of another owner are never replayed."""

    def __init__(self, store: GraphStore | None, table_width: int | None, owner: tuple):
        self.store = store
        self.table_width = table_width  # block tables of graph inputs are padded to this width
        self.owner = owner
        self.failed = False  # a capture failed: this request runs the drafter eagerly

    @property
    def on(self) -> bool:
        return self.store is not None and self.store.disabled_reason is None and not self.failed

    def can_reserve(self, cache, extra: int) -> bool:
        """Whether ``extra`` more positions per row of ``cache`` fit its pool and, with graphs on, the graphs' block
        tables (a forward planned past them, e.g. drafting ahead over room reserved for the longest case, would not
        fit a graph's static tables)."""
        if self.on and -(-(max(cache.seq_lens) + extra) // cache.block_size) > self.table_width:
            return False
        return cache.manager.can_append({s: extra for s in cache.seq_ids})

    def run(self, name: str, fn, tensors: list[torch.Tensor], *, pad_values: tuple = (), key: tuple = (),
            plan: ForwardPlan | None = None, cache=None, plans: list[ForwardPlan] | None = None):
        """``fn(*tensors)`` -- ``fn(*tensors, meta)`` for a call that writes ``cache``'s K/V by the metadata of
        ``plan`` (``cache.plan_forward``'s), run as the cache's forward; ``fn(*tensors, *metas)`` for ``plans``, one
        metadata per plan, which ``fn`` makes its cache's forward itself -- for tensors [batch, ...]; ``fn`` must
        not sync with the host. Returns its outputs (tensors, tuples of them, or objects with ``rows(n)``) for the
        real rows; a replay's outputs are the graph's static buffers, valid until its next replay. ``pad_values[i]``
        fills padding rows of ``tensors[i]`` at the capture (default 0); ``key`` adds what else fixes the call's
        shapes."""
        if plan is not None:
            fn, plans = functools.partial(_with_meta, fn, cache), [plan]
        plans = plans or []
        derive = bool(plans) and cuda_graphs.META_IN_GRAPH  # the graph derives its plans' metadata itself
        if not self.on or any(p.q_len > MAX_GRAPH_QUERY_LEN for p in plans):
            return fn(*tensors, *(p.meta() for p in plans))
        rows = tensors[0].shape[0]
        bucket = batch_bucket(rows)
        # (owner kind, call name, owner ids..., store generation, bucket, input shapes, table width, extra key,
        # the planned forwards' widths)
        graph_key = (self.owner[0], name, *self.owner[1:], self.store.generation, bucket,
                     tuple(tuple(t.shape[1:]) for t in tensors), self.table_width, *key, *(p.q_len for p in plans),
                     derive)
        graph = self.store.get("calls", graph_key)
        if graph is not None:
            # each plan's counts and tables into the graph's static inputs (the graph derives the metadata from
            # them), or its metadata straight into them; every row of the bucket
            for i, p in enumerate(plans):
                if graph.plans:
                    graph.plans[i].load(p)
                else:
                    start = len(tensors) + i * META_INPUTS
                    p.meta(out=meta_of_inputs(graph.inputs[start:start + META_INPUTS], p.q_len))
            return first_rows(graph(*tensors), rows)
        inputs = _pad_all(tensors, bucket, pad_values)
        body = fn
        if plans:
            # per plan: the static metadata, then (deriving it in the graph) the plan's counts and tables
            for p in plans:
                inputs += meta_inputs(p.meta(rows=bucket, width=self.table_width))
                if derive:
                    inputs += StaticPlan.inputs_for(p, bucket, self.table_width)
            body = functools.partial(_from_flat, fn, len(tensors), [(p.q_len, p.block_size) for p in plans], derive)
        out = body(*inputs)
        try:
            graph = CallGraph(body, inputs, devices=self.store.devices)
            if derive:
                graph.plans = [_static_plan(graph.inputs, len(tensors), i, p.q_len, p.block_size)
                               for i, p in enumerate(plans)]
            self.store.keep("calls", graph_key, graph)
        except Exception as error:  # noqa: BLE001 - any capture failure means: run eagerly
            warnings.warn(f"hf_specdec could not capture {name} of {self.owner[0]} as a CUDA graph ({error}); "
                          "running it eagerly.", RuntimeWarning, stacklevel=2)
            self.failed = True
        return first_rows(out, rows)


def _pad_all(tensors, bucket: int, pad_values: tuple) -> list[torch.Tensor]:
    values = tuple(pad_values) + (0,) * (len(tensors) - len(pad_values))
    return [pad_rows(t, bucket, v) for t, v in zip(tensors, values)]


def _with_meta(fn, cache, *tensors_and_meta):
    """``fn(*tensors, meta)`` with ``meta`` as ``cache``'s forward (its pages are the ones the layers write and
    read)."""
    with cache.forward_with(tensors_and_meta[-1]):
        return fn(*tensors_and_meta)


def _static_plan(flat, num_tensors: int, i: int, q_len: int, block_size: int) -> StaticPlan:
    """Plan ``i`` over a graph's flat inputs (its tensors, then per plan its metadata, counts and tables)."""
    start = num_tensors + i * (META_INPUTS + 2)
    meta = meta_of_inputs(flat[start:start + META_INPUTS], q_len)
    return StaticPlan(flat[start + META_INPUTS], flat[start + META_INPUTS + 1], q_len, block_size, meta)


def _from_flat(fn, num_tensors: int, shapes: list[tuple[int, int]], derive: bool, *flat):
    """``fn(*tensors, *metas)`` with each metadata over ``flat`` (a graph's static inputs); ``derive``: each derived
    there first from the plan's counts and tables (``shapes``: each plan's query slots and block size)."""
    if not derive:
        metas = [meta_of_inputs(flat[num_tensors + i * META_INPUTS:num_tensors + (i + 1) * META_INPUTS], q_len)
                 for i, (q_len, _) in enumerate(shapes)]
    else:
        metas = [_static_plan(flat, num_tensors, i, q_len, size).derive() for i, (q_len, size) in enumerate(shapes)]
    return fn(*flat[:num_tensors], *metas)


def first_rows(out, rows: int):
    """``out`` (a tensor, a tuple or list of outputs, an object with ``rows(n)``, or None) for its first ``rows``."""
    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        return out[:rows] if out.dim() and out.shape[0] > rows else out
    if isinstance(out, (tuple, list)):
        return type(out)(first_rows(o, rows) for o in out)
    return out.rows(rows)
