"""The plain-torch twins of SGLang's KV writers write the kernels' bytes (interpreted on CPU)."""

import os

import pytest
import torch

from reference.sglang_writers import quantize_separate, set_k_and_s

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels run on CPU interpreted"),
]


@pytest.mark.parametrize("scale_2d", [True, False])
def test_set_k_and_s_matches_the_kernel(scale_2d):
    from sglang.kernels.ops.kvcache.dsa_index_k_cache import _set_k_and_s_triton

    g = torch.Generator().manual_seed(1)
    ps, pages, t = 64, 5, 150
    loc = torch.randperm(pages * ps, generator=g)[:t]  # unique, across pages, first and last rows included
    loc[:2] = torch.tensor([0, pages * ps - 1])
    k = (torch.randn(t, 128, generator=g) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(t, 1, generator=g) if scale_2d else torch.rand(t, generator=g)
    before = torch.randint(0, 256, (pages, ps * 132), dtype=torch.uint8, generator=g)
    want, got = before.clone(), before.clone()
    _set_k_and_s_triton(buf=want, loc=loc, index_k=k, index_k_scale=scale, page_size=ps)
    set_k_and_s(buf=got, loc=loc, index_k=k, index_k_scale=scale, page_size=ps)
    assert not torch.equal(want, before)
    assert torch.equal(got, want)


@pytest.mark.parametrize("rope_dim", [64, 0])
def test_quantize_separate_matches_the_kernel_where_the_cast_is_exact(rope_dim):
    """Tiles built so that each value divided by its scale is an e4m3 value: no rounding, so the interpreter's
    cast is exact and every byte must match (values, scale layout, rope bytes)."""
    from sglang.kernels.ops.quantization.dsa_quant_k_cache import _quantize_k_cache_fast_separate

    g = torch.Generator().manual_seed(2)
    t = 24
    codes = torch.randint(0, 256, (t, 512), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes (0x38: 1.0)
    q = codes.view(torch.float8_e4m3fn).float()
    q.view(t, 4, 128)[:, :, 0] = 448.0  # the tile's amax: scale = 2 ** e exactly
    scale = torch.exp2(torch.randint(-12, 8, (t, 4, 1), generator=g).float())
    nope = (q.view(t, 4, 128) * scale).view(t, 512)
    assert torch.equal(nope.to(torch.bfloat16).float(), nope)  # exact in bf16 as well
    nope = nope.to(torch.bfloat16)
    rope = torch.randn(t, rope_dim, generator=g).to(torch.bfloat16)
    want = _quantize_k_cache_fast_separate(nope, rope)
    got = quantize_separate(nope, rope)
    assert [w.shape for w in want] == [w.shape for w in got] == [(t, 1, 528), (t, 1, 2 * rope_dim)]
    for w, o in zip(want, got):
        assert torch.equal(o, w)


def test_quantize_separate_rounds_to_nearest_even():
    """Where the cast rounds, the twin's value is the nearest e4m3 value (ties to even), as the GPU's."""
    y = torch.tensor([[448.0, 1.0625, 1.1875, 1.2, -3.3, 0.0]]).repeat(1, 128)[:, :128]
    nope = torch.nn.functional.pad(y, (0, 384), value=1.0).to(torch.bfloat16)
    values = quantize_separate(nope, torch.empty(1, 0, dtype=torch.bfloat16))[0][0, 0, :6]
    # amax 448: scale 1; 1.0625 ties between 1.0 and 1.125 -> 1.0 (even); 1.1875 -> 1.25 (even); 1.2 -> 1.25
    assert values.view(torch.float8_e4m3fn).float().tolist() == [448.0, 1.0, 1.25, 1.25, -3.25, 0.0]
