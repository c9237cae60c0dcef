"""Differences between the supported transformers versions (5.17 and later), in one place.

transformers 5.24 renamed the cache argument of every module, output and mask builder from
``past_key_values`` to ``cache``. Models written against either name keep working: callers ask here
which name a forward takes and which field an output carries.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

# The name transformers' model outputs, mask builders and generate() give the cache.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@functools.cache
def _cache_argument_of(function) -> str:
    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"


def cache_argument(forward) -> str:
    """The name ``forward`` (a module, a module class, a bound method or a function) takes its cache by:
    ``cache`` (transformers >= 5.24 modules) or ``past_key_values`` (earlier ones, and models written against
    them)."""
    if isinstance(forward, (type, torch.nn.Module)):
        forward = forward.forward
    return _cache_argument_of(getattr(forward, "__func__", forward))


def either_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The cache a caller passed, by its 5.24 name (``cache``) or the earlier one (``past_key_values``)."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("both cache= and past_key_values= were given; pass the cache once, as cache=.")
    return cache if cache is not None else past_key_values
