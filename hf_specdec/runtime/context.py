"""RequestContext: what one ``generate`` call's drafters get from the engine.

The target's paged cache is only a cache. What a drafter needs besides it — the request's sizes (to size its
own caches alike), where CUDA graphs are kept and how wide their block tables are, and the metadata of the
target's last forward — travels in this object, built by :meth:`ModelRunner.start`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_specdec.cache import ForwardMeta, KVLayout, PagedKVCache, sizing
from hf_specdec.config import CacheConfig
from hf_specdec.runtime.cuda_graphs import GraphStore
from hf_specdec.runtime.distributed import RankGroup, local_kv_layout
from hf_specdec.runtime.drafter_graphs import DrafterGraphs


@dataclass
class RequestContext:
    cache: PagedKVCache  # the target's
    cache_config: CacheConfig
    prompt_lens: list[int]
    max_new_tokens: int
    lookahead: int  # positions past a row's length a step may write (k + 1 when speculating)
    graph_store: GraphStore | None = None  # the model's, when this request uses CUDA graphs
    graph_table_width: int | None = None  # the widest block table a row can reach, bucketed
    forward_meta: ForwardMeta | None = None  # the target's last forward, until the runner's commit
    # per row, the tokens the target's cache holds for good after the last commit: its lengths, unless a forward
    # was queued before that commit (a round run ahead), whose tokens the lengths then hold besides
    committed_lens: list[int] | None = None
    ranks: RankGroup | None = None  # the tensor-parallel group the target is sharded over
    # the model whose attention modules write a drafter's own caches: its assistant, or the target itself when the
    # drafter drafts with the target's own extra layers (Step 3.5's MTP layers); under tensor parallelism a
    # drafter cache holds the KV heads this rank's shard of that model produces
    draft_model: torch.nn.Module | None = None

    def new_cache(self, layout: KVLayout, owner: str, *, dtype: torch.dtype, lookahead: int | None = None,
                  device: torch.device | None = None) -> PagedKVCache:
        """A drafter's own paged cache, sized for this request like the target's (``lookahead``: the drafter's,
        default the target's); its storage is pooled under ``owner`` when graphs are on (kept graphs write
        into it in later requests too); on ``device`` (default the target cache's), where the drafter runs. Under
        tensor parallelism its KV groups hold this rank's share of the heads of the :attr:`draft_model` layers they
        serve."""
        if self.ranks is not None and self.draft_model is not None:
            layout = local_kv_layout(self.draft_model, layout)
        return sizing.cache_for_request(
            layout, self.cache_config, self.prompt_lens, self.max_new_tokens,
            self.lookahead if lookahead is None else lookahead, dtype=dtype, device=device or self.cache.device,
            storage_pool=self.graph_store, storage_owner=owner,
            shared_budget=None if self.ranks is None else self.ranks.smallest)

    def drafter_graphs(self, *owner) -> DrafterGraphs:
        """The CUDA graphs of a drafter identified by ``owner`` for this request (eager when graphs are off)."""
        return DrafterGraphs(self.graph_store, self.graph_table_width, owner)
