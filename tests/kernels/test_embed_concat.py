"""embed_concat: the MTP draft step's input (scaled target embedding next to the hidden state) in one kernel."""

import pytest
import torch

from hf_specdec.kernels.embed_concat import embed_concat, embed_concat_reference


def _case(dtype, device, batch=3, vocab=50, dim=40, dim2=24):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, dim, generator=gen).to(dtype).to(device)
    hidden = torch.randn(batch, dim2, generator=gen).to(dtype).to(device)
    ids = torch.randint(vocab, (batch,), generator=gen).to(device)
    return ids, weight, hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_embed_concat_is_the_scaled_lookup_beside_hidden(triton_device, dtype):
    ids, weight, hidden = _case(dtype, triton_device)
    scale = float(torch.tensor(6.4, dtype=dtype))  # sqrt(hidden), rounded to the weight's dtype
    got = embed_concat(ids, weight, scale, hidden)
    assert got.shape == (3, 64) and got.dtype == dtype
    expected = embed_concat_reference(ids, weight, scale, hidden)
    assert torch.equal(got[:, 40:], hidden)  # copied as is
    # the product rounded once to the dtype, as torch rounds it: equal on a GPU; Triton's CPU interpreter
    # truncates where the GPU rounds to nearest (one ulp)
    exact = dtype == torch.float32 or triton_device == "cuda"
    ulp = 0 if exact else 2 ** -7
    torch.testing.assert_close(got.cpu(), expected.cpu(), atol=0, rtol=ulp)


def test_reference_is_transformers_scaled_embedding_then_cat():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    from hf_specdec.models.gemma4.assistant import fused_embedding_scale

    ids, weight, hidden = _case(torch.bfloat16, "cpu")
    embed = Gemma4TextScaledWordEmbedding(50, 40, 0, embed_scale=40 ** 0.5).to(torch.bfloat16)
    embed.weight.data.copy_(weight)
    scale = fused_embedding_scale(embed, torch.bfloat16)
    assert scale == float(torch.tensor(40 ** 0.5).to(torch.bfloat16))
    expected = torch.cat([embed(ids), hidden], dim=-1)
    assert torch.equal(embed_concat_reference(ids, weight, scale, hidden), expected)
    assert fused_embedding_scale(embed, torch.float32) is None  # the assistant in another dtype: the module runs
    embed.register_forward_hook(lambda *args: None)
    assert fused_embedding_scale(embed, torch.bfloat16) is None  # a hook must see the call


def test_bad_input_names_the_fix():
    ids, weight, hidden = _case(torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="exact in it"):
        embed_concat(ids, weight, 0.1, hidden)  # not a bf16 value
    with pytest.raises(ValueError, match="of one dtype"):
        embed_concat(ids, weight, 2.0, hidden.float())
