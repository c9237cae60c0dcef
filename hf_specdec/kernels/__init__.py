"""Kernels of hf_specdec: each is a Triton body, a launcher that checks its arguments, and a torch
reference that is both the CPU path and the test oracle. Imports no transformers.

- `store_kv`: write new keys/values into the paged cache by slot.
- `paged_attention`: prefill / verify / decode / Q-only attention over paged K/V, sliding windows, GQA.
- `use_triton`: which of the two paths a tensor takes (``HF_SPECDEC_FORCE_TRITON`` overrides).
"""

from ._dispatch import use_triton
from .paged_attention import paged_attention, paged_attention_reference
from .store_kv import store_kv, store_kv_reference

__all__ = ["paged_attention", "paged_attention_reference", "store_kv", "store_kv_reference", "use_triton"]
