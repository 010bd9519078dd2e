"""The plain-torch twin of SGLang's indexer-key writer writes the kernel's bytes (interpreted on CPU)."""

import os

import pytest
import torch

from reference.sglang_writers import set_k_and_s

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
