"""store_kv writes exactly the slots it is given, skips slots < 0, and leaves every other entry alone."""

from dataclasses import dataclass

import pytest
import torch

from hf_specdec.kernels import store_kv, store_kv_reference, use_triton
from hf_specdec.kernels.store_kv import store_kv_layers


@dataclass
class StoreCase:
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    k_buffer: torch.Tensor  # [num_blocks + 2, block_size, num_kv_heads, head_dim]: caches plus guard blocks
    v_buffer: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens]

    def args(self):
        # The caches are contiguous views between two guard blocks that catch writes out of range.
        return [self.key, self.value, self.k_buffer[1:-1], self.v_buffer[1:-1], self.slot_mapping]

    def expected_buffers(self):
        """Entry by entry: what the buffers must hold after store_kv."""
        k_expected, v_expected = self.k_buffer.clone(), self.v_buffer.clone()
        block_size = k_expected.shape[1]
        for token, slot in enumerate(self.slot_mapping.tolist()):
            if slot >= 0:
                block, offset = 1 + slot // block_size, slot % block_size
                k_expected[block, offset] = self.key[token].to(k_expected.dtype)
                v_expected[block, offset] = self.value[token].to(v_expected.dtype)
        return k_expected, v_expected


def make_store_case(*, num_tokens=7, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=16,
                    key_dtype=torch.float32, cache_dtype=torch.float32, slot_dtype=torch.int64, seed=0,
                    device="cpu") -> StoreCase:
    """Random keys/values, a poisoned random cache, distinct random slots with two padding tokens."""
    gen = torch.Generator().manual_seed(seed)
    key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(key_dtype) for _ in range(2))
    buffer_shape = (num_blocks + 2, block_size, num_kv_heads, head_dim)
    k_buffer, v_buffer = (torch.randn(buffer_shape, generator=gen).to(cache_dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, num_tokens - 1]] = -1
    return StoreCase(*(t.to(device) for t in (key, value, k_buffer, v_buffer, slots.to(slot_dtype))))


def assert_stored(case: StoreCase, k_expected, v_expected, rtol=0.0):
    torch.testing.assert_close(case.k_buffer, k_expected, rtol=rtol, atol=0)
    torch.testing.assert_close(case.v_buffer, v_expected, rtol=rtol, atol=0)


@pytest.mark.parametrize("key_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reference_writes_slots_and_skips_padding(key_dtype, cache_dtype, slot_dtype):
    case = make_store_case(key_dtype=key_dtype, cache_dtype=cache_dtype, slot_dtype=slot_dtype)
    k_expected, v_expected = case.expected_buffers()
    assert not torch.equal(case.k_buffer, k_expected)
    store_kv_reference(*case.args())
    assert_stored(case, k_expected, v_expected)


@pytest.mark.parametrize("padding", [True, False])
@pytest.mark.parametrize("key_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_cpu_path_writes_slots_and_skips_padding(monkeypatch, padding, key_dtype, cache_dtype, slot_dtype):
    """The CPU path (one index_copy_ per cache, padding filtered only when present) writes what the reference does."""
    monkeypatch.delenv("HF_SPECDEC_FORCE_TRITON", raising=False)
    case = make_store_case(seed=1, key_dtype=key_dtype, cache_dtype=cache_dtype, slot_dtype=slot_dtype)
    if not padding:  # a decode or verify forward: every token has a slot
        free = [slot for slot in range(24) if slot not in case.slot_mapping.tolist()][:2]
        case.slot_mapping[case.slot_mapping < 0] = torch.tensor(free, dtype=slot_dtype)
    assert not use_triton(case.key)
    k_expected, v_expected = case.expected_buffers()
    store_kv(*case.args())
    assert_stored(case, k_expected, v_expected)


@pytest.mark.parametrize("padding", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_layers_writes_each_layer_as_store_kv(monkeypatch, padding, cache_dtype):
    """Several layers of one KV group at once (``store_kv_layers``: one write per storage on the CPU, layer by layer
    elsewhere): each layer's storage holds what ``store_kv`` of that layer writes, padding slots skipped, every other
    entry (the guard blocks, the other layers' slots) untouched."""
    monkeypatch.delenv("HF_SPECDEC_FORCE_TRITON", raising=False)
    cases = [make_store_case(seed=10 + i, cache_dtype=cache_dtype) for i in range(3)]
    slots = cases[0].slot_mapping
    if not padding:
        free = [slot for slot in range(24) if slot not in slots.tolist()][:2]
        slots[slots < 0] = torch.tensor(free, dtype=slots.dtype)
    k_storage = torch.stack([c.k_buffer for c in cases])  # [layers, blocks + guards, block_size, heads, dim]
    v_storage = torch.stack([c.v_buffer for c in cases])
    expected = []
    for c in cases:
        c.slot_mapping = slots
        expected.append(c.expected_buffers())
    store_kv_layers(torch.stack([c.key for c in cases]), torch.stack([c.value for c in cases]), k_storage[:, 1:-1],
                    v_storage[:, 1:-1], slots)
    for i, (k_expected, v_expected) in enumerate(expected):
        torch.testing.assert_close(k_storage[i], k_expected, rtol=0, atol=0)
        torch.testing.assert_close(v_storage[i], v_expected, rtol=0, atol=0)


def test_store_kv_layers_names_the_shapes_it_takes():
    case = make_store_case()
    with pytest.raises(ValueError, match=r"store_kv_layers takes keys/values \[layers, tokens"):
        store_kv_layers(case.key, case.value, case.k_buffer[None], case.v_buffer[None], case.slot_mapping)


@pytest.mark.parametrize("head_dim,key_dtype,cache_dtype,slot_dtype", [
    (16, torch.float32, torch.float32, torch.int64),
    (80, torch.float32, torch.bfloat16, torch.int32),
    (32, torch.bfloat16, torch.bfloat16, torch.int64),
    (16, torch.float16, torch.float16, torch.int32),
])
def test_triton_store_kv_matches_expected(triton_device, head_dim, key_dtype, cache_dtype, slot_dtype):
    case = make_store_case(head_dim=head_dim, key_dtype=key_dtype, cache_dtype=cache_dtype,
                           slot_dtype=slot_dtype, seed=2, device=triton_device)
    k_expected, v_expected = case.expected_buffers()
    assert use_triton(case.key)
    store_kv(*case.args())
    # GPUs round fp32 -> bf16 to nearest even like torch; Triton's CPU interpreter (3.9) truncates.
    assert_stored(case, k_expected, v_expected,
                  rtol=2**-7 if triton_device == "cpu" and key_dtype != cache_dtype else 0.0)


def test_triton_store_kv_strided_keys(triton_device):
    # Keys as the attention layer has them: a transpose of HF's [num_kv_heads, num_tokens, head_dim].
    case = make_store_case(num_kv_heads=3, seed=3, device=triton_device)
    case.key, case.value = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (case.key, case.value))
    k_expected, v_expected = case.expected_buffers()
    store_kv(*case.args())
    assert_stored(case, k_expected, v_expected)


@pytest.mark.parametrize("position,replace,message", [
    (0, lambda key: key[..., :8], "head_dim=8"),
    (0, lambda key: key[:, :1], "num_kv_heads=1"),
    (2, lambda cache: cache.transpose(0, 1).contiguous().transpose(0, 1), "contiguous"),
    (3, lambda cache: cache.half(), "must share one dtype"),
    (4, lambda slots: slots.float(), "slot_mapping must be a contiguous int32 or int64"),
    (4, lambda slots: slots[:3], r"slot_mapping must be \[num_tokens=7\]"),
])
def test_launcher_errors(position, replace, message):
    args = make_store_case().args()
    args[position] = replace(args[position])
    with pytest.raises(ValueError, match=message):
        store_kv(*args)
