"""fp8 quantizers against hand-computed bytes."""

import pytest
import torch

from reference.kv_formats import (
    decode_mla_rows,
    dequantize_index_k,
    encode_mla_rows,
    quantize_index_k,
    quantize_mla_fp8,
)
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import MLA_BF16_ROW_BYTES, MLA_FP8_ROW_BYTES, mla_row_bytes


def test_mla_fp8_row_hand_computed():
    latent = torch.zeros(1, 512)
    latent[0, 0] = 448.0  # tile 0: amax 448 -> scale 2**ceil(log2(1)) = 1
    latent[0, 1] = -3.0
    latent[0, 128] = 1000.0  # tile 1: 1000/448 = 2.23 -> scale 4; 1000/4 = 250 -> e4m3 256 (0x78)
    latent[0, 256] = 1e-6  # tile 2: amax/448 < 1e-4 -> scale 2**ceil(log2(1e-4)) = 2**-13
    # tile 3 all zero -> scale 2**-13, values 0
    rope = torch.arange(64, dtype=torch.float32).unsqueeze(0)
    row = quantize_mla_fp8(latent, rope)
    assert row.shape == (1, MLA_FP8_ROW_BYTES) and row.dtype == torch.uint8
    assert row[0, 0].item() == 0x7E  # 448 = 1.75 * 2**8: sign 0, exp 15, mantissa 110
    assert row[0, 1].item() == 0xC4  # -3 = -1.5 * 2**1: sign 1, exp 8, mantissa 100
    assert row[0, 128].item() == 0x78  # 256 = 2**8: exp 15, mantissa 000 (250 rounds to 256)
    assert row[0, 256].item() == 0x04  # 1e-6 / 2**-13 = 0.0082 = 4.19 * 2**-9: subnormal, mantissa 100
    scales = row[0, 512:528].view(torch.float32).tolist()
    assert scales == [1.0, 4.0, 2.0**-13, 2.0**-13]
    assert torch.equal(row[0, 528:].view(torch.bfloat16).float(), rope[0])
    back = decode_mla_rows(row, "fp8")
    assert back[0, 0] == 448.0 and back[0, 1] == -3.0 and back[0, 128] == 1024.0 and back[0, 512 + 5] == 5.0


def test_mla_fp8_round_trip_error_is_within_half_an_e4m3_step():
    torch.manual_seed(0)
    latent, rope = torch.randn(64, 512) * 10, torch.randn(64, 64)
    back = decode_mla_rows(encode_mla_rows(latent, rope, "fp8"), "fp8")
    tiles = latent.reshape(64, 4, 128)
    scale = torch.exp2(torch.ceil(torch.log2(tiles.abs().amax(-1, keepdim=True) / 448)))
    err = (back[:, :512].reshape(64, 4, 128) - tiles).abs()
    assert torch.all(err <= scale * 16 + 1e-6)  # e4m3: 3 mantissa bits, |x/s| <= 448 -> step <= 32
    assert torch.equal(back[:, 512:], rope.to(torch.bfloat16).float())


def test_bf16_rows_are_raw_bf16():
    latent, rope = torch.randn(3, 512), torch.randn(3, 64)
    rows = encode_mla_rows(latent, rope, "bf16")
    assert rows.shape == (3, MLA_BF16_ROW_BYTES)
    assert torch.equal(decode_mla_rows(rows, "bf16"), torch.cat([latent, rope], 1).to(torch.bfloat16).float())


def test_index_k_hand_computed():
    k = torch.zeros(2, 128)
    k[0, 0], k[0, 1] = 100.0, -0.5  # amax 100 -> 100/448 = 0.223 -> scale 0.25; 100/0.25 = 400
    k[1, 3] = 1e-9  # amax below 1e-4 -> 1e-4/448 -> scale 2**-22
    k_u8, scale = quantize_index_k(k)
    assert scale.tolist() == [0.25, 2.0**-22]
    assert k_u8[0, 0].item() == 0x7C  # 400 = 1.5625 * 2**8, a tie between 1.5 and 1.625: to even, 384
    assert k_u8[0, 1].item() == 0xC0  # -2 = -1.0 * 2**1: sign 1, exp 8, mantissa 000
    assert dequantize_index_k(k_u8, scale)[0, :2].tolist() == [96.0, -0.5]


def test_bad_format_names_the_argument():
    with pytest.raises(ValueError, match="kv_format must be one of"):
        mla_row_bytes("fp16")
    with pytest.raises(ValueError, match="latent/rope"):
        quantize_mla_fp8(torch.zeros(1, 500), torch.zeros(1, 64))


def test_index_page_views_are_views_of_the_page_layout():
    from reference.kv_formats import index_page_views

    ps = 4
    pages = torch.zeros(3, ps * 132, dtype=torch.uint8)
    k, scale = index_page_views(pages, ps)
    assert k.shape == (3, ps, 128) and k.dtype == torch.uint8
    assert scale.shape == (3, ps) and scale.dtype == torch.float32
    k[1, 2] = 7
    scale[1, 2] = 2.0
    assert pages[1, 2 * 128 : 3 * 128].eq(7).all() and pages[1, : 2 * 128].eq(0).all()
    assert pages[1, ps * 128 + 8 : ps * 128 + 12].view(torch.float32).item() == 2.0


def test_format_constants_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from sglang_cp_shared_kv.srt.mem_cache import kv_layout_constants as c\n"
        "from sglang_cp_shared_kv.srt.utils import check_int\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert (c.MLA_FP8_ROW_BYTES, c.MLA_BF16_ROW_BYTES, c.INDEX_TOKEN_BYTES) == (656, 1152, 132)\n"
        "assert c.mla_row_bytes('bf16') == 1152 and c.KV_FORMATS == ('fp8', 'bf16')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
