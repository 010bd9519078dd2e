"""Gather kernel bandwidth: the materialize page gather vs ``torch.index_select`` vs a plain copy.

For every size, the same pages (page size 64, random order, as a plan leaves them) are moved
three ways: our Triton ``gather_page_buffers`` (latent + indexer pages in one launch), ``index_select`` on the
same page ids, and a device-to-device copy of the same number of contiguous bytes (the ceiling).
L2 is flushed before each timed call.

    python -m benchmark.cp_shared_kv.bench_gather
"""

from __future__ import annotations

import argparse

import torch

from benchmark.cp_shared_kv.bench_common import cuda_time_cold_us, save_plot, write_result
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import gather_page_buffers
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_TOKEN_BYTES, mla_row_bytes

PAGE = 64


def run(tokens_list: list[int], formats: list[str]) -> list[dict]:
    rows = []
    for kv_format in formats:
        row_bytes = mla_row_bytes(kv_format)
        for tokens in tokens_list:
            pages = tokens // PAGE
            pool_pages = 2 * pages + 1
            latent = torch.randint(0, 255, (pool_pages, PAGE * row_bytes), dtype=torch.uint8, device="cuda")
            index = torch.randint(0, 255, (pool_pages, PAGE * INDEX_TOKEN_BYTES), dtype=torch.uint8, device="cuda")
            ids = torch.randperm(pool_pages - 1, device="cuda")[:pages]
            out_l = torch.empty(pages, latent.shape[1], dtype=torch.uint8, device="cuda")
            out_i = torch.empty(pages, index.shape[1], dtype=torch.uint8, device="cuda")

            def ours():
                gather_page_buffers([latent, index], ids, [out_l, out_i])  # one launch for both

            def index_select():
                torch.index_select(latent, 0, ids, out=out_l)
                torch.index_select(index, 0, ids, out=out_i)

            def copy():
                out_l.copy_(latent[:pages])
                out_i.copy_(index[:pages])

            ours()
            assert torch.equal(out_l, latent[ids]) and torch.equal(out_i, index[ids])
            payload = pages * (latent.shape[1] + index.shape[1])
            t = {
                name: cuda_time_cold_us(fn)
                for name, fn in [("gather", ours), ("index_select", index_select), ("copy", copy)]
            }
            row = {
                "kv_format": kv_format,
                "tokens": tokens,
                "pages": pages,
                "payload_bytes": payload,
                **{f"{k}_us": round(v, 2) for k, v in t.items()},
                # Bandwidth counts bytes read plus bytes written.
                **{f"{k}_GBps": round(2 * payload / v / 1e3, 1) for k, v in t.items()},
                "gather_vs_copy": round(t["copy"] / t["gather"], 3),
                "gather_vs_index_select": round(t["index_select"] / t["gather"], 3),
            }
            print(row)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072, 524288])
    ap.add_argument("--formats", nargs="+", default=["fp8", "bf16"])
    args = ap.parse_args()
    rows = run(args.tokens, args.formats)

    def at(fmt, tokens, key):
        return next(r[key] for r in rows if r["kv_format"] == fmt and r["tokens"] == tokens)

    big = [r for r in rows if r["tokens"] >= 32768]
    summary = {
        "gather_vs_copy_at_32k": at("fp8", 32768, "gather_vs_copy") if 32768 in args.tokens else None,
        "gather_vs_copy_min_at_ge_32k": min(r["gather_vs_copy"] for r in big) if big else None,
        "gather_vs_index_select_at_32k": at("fp8", 32768, "gather_vs_index_select") if 32768 in args.tokens else None,
        "goal": "gather >= 0.9x copy bandwidth at >= 32K tokens",
    }
    write_result("gather", rows, summary)

    def draw(ax):
        for fmt, style in (("fp8", "-"), ("bf16", "--")):
            sel = [r for r in rows if r["kv_format"] == fmt]
            for key, color in (("gather", "C0"), ("index_select", "C1"), ("copy", "C2")):
                ax.plot(
                    [r["tokens"] for r in sel],
                    [r[f"{key}_GBps"] for r in sel],
                    style,
                    color=color,
                    marker="o",
                    label=f"{key} ({fmt})",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens gathered (page size 64)")
        ax.set_ylabel("GB/s (read + write)")
        ax.set_title("materialize gather vs index_select vs copy")
        ax.legend(fontsize=7)

    save_plot("gather", draw)


if __name__ == "__main__":
    main()
