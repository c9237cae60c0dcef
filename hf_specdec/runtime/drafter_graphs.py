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
  never store anything; the function runs with that metadata as the cache's forward.
"""

from __future__ import annotations

import functools
import warnings

import torch

from hf_specdec.cache import ForwardPlan
from hf_specdec.runtime.cuda_graphs import (
    MAX_GRAPH_QUERY_LEN,
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

    def run(self, name: str, fn, tensors: list[torch.Tensor], *, pad_values: tuple = (), key: tuple = (),
            plan: ForwardPlan | None = None, cache=None):
        """``fn(*tensors)`` — or ``fn(*tensors, meta)`` for a call that writes ``cache``'s K/V by the metadata of
        ``plan`` (``cache.plan_forward``'s) — for tensors [batch, ...]; ``fn`` must not sync with the host. Returns
        its outputs (tensors, tuples of them, or objects with ``rows(n)``) for the real rows; a replay's outputs
        are the graph's static buffers, valid until its next replay. ``pad_values[i]`` fills padding rows of
        ``tensors[i]`` at the capture (default 0); ``key`` adds what else fixes the call's shapes."""
        if not self.on or (plan is not None and plan.q_len > MAX_GRAPH_QUERY_LEN):
            if plan is None:
                return fn(*tensors)
            with cache.forward_with(plan.meta()) as meta:
                return fn(*tensors, meta)
        rows = tensors[0].shape[0]
        bucket = batch_bucket(rows)
        # (owner kind, call name, owner ids..., store generation, bucket, input shapes, table width, extra key)
        graph_key = (self.owner[0], name, *self.owner[1:], self.store.generation, bucket,
                     tuple(tuple(t.shape[1:]) for t in tensors), self.table_width, *key)
        if plan is not None:
            graph_key = (*graph_key, plan.q_len)
        graph = self.store.get("calls", graph_key)
        if graph is not None:
            if plan is not None:  # the metadata straight into the graph's static inputs, every row of the bucket
                plan.meta(out=meta_of_inputs(graph.inputs[len(tensors):], plan.q_len))
            return first_rows(graph(*tensors), rows)
        inputs = _pad_all(tensors, bucket, pad_values)
        body = fn
        if plan is not None:
            inputs += meta_inputs(plan.meta(rows=bucket, width=self.table_width))
            body = functools.partial(_with_meta, fn, cache, len(tensors), plan.q_len)
        out = body(*inputs)
        try:
            self.store.keep("calls", graph_key, CallGraph(body, inputs))
        except Exception as error:  # noqa: BLE001 - any capture failure means: run eagerly
            warnings.warn(f"hf_specdec could not capture {name} of {self.owner[0]} as a CUDA graph ({error}); "
                          "running it eagerly.", RuntimeWarning, stacklevel=2)
            self.failed = True
        return first_rows(out, rows)


def _pad_all(tensors, bucket: int, pad_values: tuple) -> list[torch.Tensor]:
    values = tuple(pad_values) + (0,) * (len(tensors) - len(pad_values))
    return [pad_rows(t, bucket, v) for t, v in zip(tensors, values)]


def _with_meta(fn, cache, num_tensors: int, q_len: int, *flat):
    """``fn(*tensors, meta)`` with the metadata rebuilt from ``flat`` (a graph's static inputs) and set as
    ``cache``'s forward (its pages are the ones the layers write and read)."""
    meta = meta_of_inputs(flat[num_tensors:], q_len)
    with cache.forward_with(meta):
        return fn(*flat[:num_tensors], meta)


def first_rows(out, rows: int):
    """``out`` (a tensor, a tuple or list of outputs, an object with ``rows(n)``, or None) for its first ``rows``."""
    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        return out[:rows] if out.dim() and out.shape[0] > rows else out
    if isinstance(out, (tuple, list)):
        return type(out)(first_rows(o, rows) for o in out)
    return out.rows(rows)
