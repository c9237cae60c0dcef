"""Attention through the paged cache, registered with transformers as ``"hf_specdec"``."""

from hf_specdec.attention.paged import (
    ATTENTION_NAME,
    QueryRows,
    hf_specdec_attention,
    paged_attention_forward,
    paged_query_attention,
    register,
)

__all__ = [
    "ATTENTION_NAME", "QueryRows", "hf_specdec_attention", "paged_attention_forward", "paged_query_attention", "register",
]
