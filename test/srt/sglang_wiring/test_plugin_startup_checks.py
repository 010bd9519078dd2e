"""Startup checks of ``--enable-cp-shared-kv`` run by SGLang 0.5.23's own argument resolution.

All cases run in ONE worker subprocess (plugin hooks cannot be undone, and
each sglang import costs seconds): the worker loads the plugin through
SGLang's ``load_plugins()``, then for every case either runs the real
``ServerArgs.resolve_once()`` pipeline ("pipeline") or, where that pipeline
cannot run on a CPU machine (DSA resolution reads the CUDA device
capability), calls the late check on a record carrying the resolved values
explicitly ("resolved"); "other_version" runs the pipeline while SGLang's
version module reports another release.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from plugin_models import run_worker, write_model_dirs

pytestmark = pytest.mark.sglang

GOOD = [
    "--enable-cp-shared-kv",
    "--enable-prefill-cp",
    "--cp-strategy",
    "interleave",
    "--tp-size",
    "8",
    "--attn-cp-size",
    "8",
    "--disaggregation-mode",
    "prefill",
    "--disaggregation-transfer-backend",
    "mooncake",
    "--skip-tokenizer-init",
]
# What resolution would decide on an H200 for a DSA model, stated explicitly.
DSA_RESOLVED = ["--device", "cuda", "--page-size", "64", "--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "dsa"]


def _without(argv: list[str], flag: str, takes_value: bool = True) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 + int(takes_value) :]


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return argv[: i + 1] + [value] + argv[i + 2 :]


# A decode CP server with the flag (--dcp-size over as many TP ranks).
DECODE_CP = [
    "--enable-cp-shared-kv",
    "--disaggregation-mode",
    "decode",
    "--disaggregation-transfer-backend",
    "mooncake",
    "--tp-size",
    "2",
    "--dcp-size",
    "2",
    "--skip-tokenizer-init",
]
DECODE_CP_RESOLVED = DSA_RESOLVED + ["--dsa-decode-backend", "flashmla_kv"]

# (case id, model, mode, argv, expected: None = accepted, else the flag the one line must name)
CASES = [
    # -- rejections by the early hook, through the real pipeline --
    ("prefill_cp_off", "dsa", "pipeline", _without(GOOD, "--enable-prefill-cp", False), "add --enable-prefill-cp"),
    ("zigzag", "dsa", "pipeline", _with(GOOD, "--cp-strategy", "zigzag"), "use --cp-strategy interleave"),
    ("no_pd", "dsa", "pipeline", _without(GOOD, "--disaggregation-mode"), "--disaggregation-mode prefill"),
    ("pd_decode", "dsa", "pipeline", _with(GOOD, "--disaggregation-mode", "decode"), "--disaggregation-mode prefill"),
    (
        "nixl",
        "dsa",
        "pipeline",
        _with(GOOD, "--disaggregation-transfer-backend", "nixl"),
        "--disaggregation-transfer-backend mooncake",
    ),
    ("kv_cache_sharding", "dsa", "pipeline", GOOD + ["--enable-kv-cache-sharding"], "--enable-kv-cache-sharding"),
    ("dsa_layer_split", "dsa", "pipeline", GOOD + ["--enable-dsa-cache-layer-split"], "--enable-dsa-cache-layer-split"),
    ("decode_cp", "dsa", "pipeline", GOOD + ["--dcp-size", "2"], "--dcp-size"),
    ("cp_decode_attn_tp", "dsa", "pipeline", GOOD + ["--enable-cp-decode-attn-tp"], "--enable-cp-decode-attn-tp"),
    ("page_size_48", "dsa", "pipeline", GOOD + ["--page-size", "48"], "--page-size 48 is not a power of two"),
    ("pp_2", "dsa", "pipeline", GOOD + ["--pp-size", "2"], "--pp-size"),
    ("speculative", "dsa", "pipeline", GOOD + ["--speculative-algorithm", "EAGLE"], "--speculative-algorithm"),
    ("hicache", "dsa", "pipeline", GOOD + ["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
    ("two_batch_overlap", "dsa", "pipeline", GOOD + ["--enable-two-batch-overlap"], "--enable-two-batch-overlap"),
    ("hisparse", "dsa", "pipeline", GOOD + ["--enable-hisparse"], "--enable-hisparse"),
    (
        "chunk_not_page_multiple",
        "dsa",
        "pipeline",
        GOOD + ["--page-size", "64", "--chunked-prefill-size", "1000"],
        "--chunked-prefill-size 1000",
    ),
    (
        "chunked_prefill_off",
        "dsa",
        "pipeline",
        GOOD + ["--page-size", "64", "--chunked-prefill-size", "-1"],
        "--chunked-prefill-size -1 turns chunked prefill off",
    ),
    ("dummy_model", "dummy", "pipeline", GOOD, "--model-path dummy"),
    # -- an SGLang that reports another version: one line naming both, the override's variable too --
    ("other_sglang_version", "dsa", "other_version", GOOD, "SGLang 0.5.24 is installed, and the plugin's hooks"),
    # -- rejections by the late hook, through the real pipeline (these models resolve on CPU) --
    ("not_mla", "gqa", "pipeline", GOOD + ["--device", "cpu"], "is not an MLA model"),
    ("cpu_device", "mla", "pipeline", GOOD + ["--device", "cpu"], "--device cpu"),
    # SGLang sets a DeepSeek model's attention CP size itself: judged on what it resolves to
    ("cp_resolves_to_1", "mla", "pipeline", GOOD + ["--attn-dp-size", "8", "--device", "cpu"], "nothing to shard over"),
    ("no_attn_cp_size", "mla", "pipeline", _without(GOOD, "--attn-cp-size") + ["--device", "cpu"], "--device cpu"),
    # -- rejections by the late check on explicitly resolved values --
    (
        "dsa_kernel_tilelang",
        "dsa",
        "resolved",
        GOOD + DSA_RESOLVED + ["--dsa-prefill-backend", "tilelang"],
        "--dsa-prefill-backend tilelang",
    ),
    (
        "dsa_not_on_dsa_backend",
        "dsa",
        "resolved",
        _with(GOOD + DSA_RESOLVED, "--attention-backend", "flashmla"),
        "use --attention-backend dsa",
    ),
    (
        "dsa_index_kpool",
        "dsa_kpool",
        "resolved",
        GOOD + DSA_RESOLVED + ["--dsa-prefill-backend", "flashmla_sparse"],
        "index_kpool",
    ),
    (  # the page size SGLang sets for a pooled indexer (64 x the pool factor): the pooled indexer's line alone
        "dsa_index_kpool_page_256",
        "dsa_kpool",
        "resolved",
        _with(GOOD + DSA_RESOLVED, "--page-size", "256") + ["--dsa-prefill-backend", "flashmla_sparse"],
        "index_kpool",
    ),
    (
        "dsa_prefill_backend_flag",
        "dsa",
        "resolved",
        GOOD + DSA_RESOLVED + ["--prefill-attention-backend", "flashmla"],
        "drop --prefill-attention-backend flashmla and use --attention-backend dsa",
    ),
    (  # the plugin's environment settings (CASE_ENV), each a line of its own
        "bad_settings",
        "dsa",
        "resolved",
        GOOD + DSA_RESOLVED + ["--dsa-prefill-backend", "flashmla_sparse"],
        "SGLANG_CP_SHARED_KV_TRANSPORT must be one of auto, copy_engine, nccl, got 'bogus'",
    ),
    (
        "bad_peer_timeout",
        "dsa",
        "resolved",
        GOOD + DSA_RESOLVED + ["--dsa-prefill-backend", "flashmla_sparse"],
        "SGLANG_CP_SHARED_KV_PEER_TIMEOUT must be a positive number of seconds",
    ),
    (
        "mla_triton",
        "mla",
        "resolved",
        GOOD + ["--device", "cuda", "--page-size", "64", "--attention-backend", "triton"],
        "--prefill-attention-backend fa3",
    ),
    (  # --attention-backend fa3 with an e5m2 cache, as SGLang's attention resolution leaves it (fa3 moved to
        # triton) before the late check runs: the line names the dtype as the fix
        "mla_fa3_e5m2",
        "mla",
        "resolved",
        GOOD
        + ["--device", "cuda", "--page-size", "64", "--attention-backend", "triton", "--kv-cache-dtype", "fp8_e5m2"],
        "use --kv-cache-dtype fp8_e4m3 or auto with --prefill-attention-backend fa3",
    ),
    (
        "mla_page_1",
        "mla",
        "resolved",
        GOOD + ["--device", "cuda", "--page-size", "1", "--attention-backend", "fa3"],
        "must be a power of two greater than 1",
    ),
    # -- accepted configurations --
    (
        "ok_dsa_flashmla_sparse",
        "dsa",
        "resolved",
        GOOD + DSA_RESOLVED + ["--dsa-prefill-backend", "flashmla_sparse"],
        None,
    ),
    ("ok_dsa_trtllm", "dsa", "resolved", GOOD + DSA_RESOLVED + ["--dsa-prefill-backend", "trtllm"], None),
    (
        "ok_dsa_bf16",
        "dsa",
        "resolved",
        _with(GOOD + DSA_RESOLVED, "--kv-cache-dtype", "bf16") + ["--dsa-prefill-backend", "flashmla_sparse"],
        None,
    ),
    (
        "dsa_page_32",
        "dsa",
        "resolved",
        _with(GOOD + DSA_RESOLVED, "--page-size", "32") + ["--dsa-prefill-backend", "flashmla_sparse"],
        "set --page-size 64",
    ),
    (
        "ok_mla_fa3",
        "mla",
        "resolved",
        GOOD + ["--device", "cuda", "--page-size", "64", "--attention-backend", "fa3"],
        None,
    ),
    # -- a decode CP server: admitted for a DSA model on FlashMLA's decode kernel, the rest refused --
    ("ok_decode_cp", "dsa", "resolved", DECODE_CP + DECODE_CP_RESOLVED, None),
    (
        "ok_decode_cp_bf16",
        "dsa",
        "resolved",
        DECODE_CP + _with(DSA_RESOLVED, "--kv-cache-dtype", "bf16") + ["--dsa-decode-backend", "flashmla_sparse"],
        None,
    ),
    (
        "decode_cp_kernel",
        "dsa",
        "resolved",
        DECODE_CP + _with(DECODE_CP_RESOLVED, "--dsa-decode-backend", "flashmla_sparse"),
        "--dsa-decode-backend flashmla_sparse on a decode CP server",
    ),
    (
        "decode_cp_not_dsa",
        "mla",
        "resolved",
        DECODE_CP + ["--device", "cuda", "--page-size", "64"],
        "the flag shards a DSA model's latent and indexer pages there",
    ),
    ("decode_cp_index_kpool", "dsa_kpool", "resolved", DECODE_CP + DECODE_CP_RESOLVED, "index_kpool"),
    (
        "decode_cp_speculative",
        "dsa",
        "pipeline",
        DECODE_CP + ["--speculative-algorithm", "EAGLE"],
        "--speculative-algorithm",
    ),
    (
        "decode_cp_hicache",
        "dsa",
        "pipeline",
        DECODE_CP + ["--enable-hierarchical-cache"],
        "--enable-hierarchical-cache",
    ),
    ("decode_cp_hisparse", "dsa", "pipeline", DECODE_CP + ["--enable-hisparse"], "--enable-hisparse"),
    ("decode_attn_cp", "dsa", "pipeline", DECODE_CP + ["--attn-cp-size", "2"], "--attn-cp-size 2 on the decode server"),
    # -- flag off: the same rejected shapes resolve as stock --
    (
        "off_zigzag_gqa",
        "gqa",
        "pipeline",
        _without(_with(GOOD, "--cp-strategy", "zigzag"), "--enable-cp-shared-kv", False) + ["--device", "cpu"],
        None,
    ),
    ("off_mla_cpu", "mla", "pipeline", _without(GOOD, "--enable-cp-shared-kv", False) + ["--device", "cpu"], None),
]


# Environment settings per case, set for its resolution only.
CASE_ENV = {
    "bad_settings": {
        "SGLANG_CP_SHARED_KV_ARENA_CONTEXTS": "0",
        "SGLANG_CP_SHARED_KV_PREFETCH": "2",
        "SGLANG_CP_SHARED_KV_TRANSPORT": "bogus",
    },
    "bad_peer_timeout": {"SGLANG_CP_SHARED_KV_PEER_TIMEOUT": "-1"},
}


def _worker(model_dir: str) -> None:
    """Runs every case in this process; prints one JSON line."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.version
    from sglang.srt.server_args import prepare_server_args

    from sglang_cp_shared_kv.srt.sglang_wiring.decode_server import decode_cp_rejections
    from sglang_cp_shared_kv.srt.sglang_wiring.startup_checks import CPSharedKVStartupError, resolved_rejections

    results = {}
    for case_id, model, mode, argv, _ in CASES:
        path = model if model == "dummy" else os.path.join(model_dir, model)
        real_version = sglang.version.__version__
        if mode == "other_version":  # what the checks read: SGLang's own version module
            sglang.version.__version__ = "0.5.24"
        saved = {name: os.environ.get(name) for name in CASE_ENV.get(case_id, {})}
        os.environ.update(CASE_ENV.get(case_id, {}))
        try:
            server_args = prepare_server_args(["--model-path", path] + argv)
            if mode in ("pipeline", "other_version"):
                server_args.resolve_once()
            else:
                lines = resolved_rejections(server_args, decode_cp_rejections)  # as the plugin's hook
                if lines:
                    raise CPSharedKVStartupError("\n".join(lines))
            results[case_id] = {"accepted": True, "flag_on": bool(getattr(server_args, "enable_cp_shared_kv", False))}
        except Exception as e:  # the case table says which ones must fail
            results[case_id] = {"accepted": False, "error": f"{type(e).__name__}: {e}"}
        finally:
            sglang.version.__version__ = real_version
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    results["_overrides"] = _dcp_overrides(model_dir)
    print("RESULT:" + json.dumps(results))


# SGLang's DSA DCP overrides (its model-override step) on a decode CP server, by argv.
OVERRIDE_CASES = {
    "flag_fp8": DECODE_CP + ["--kv-cache-dtype", "fp8_e4m3"],
    "flag_bf16": DECODE_CP + ["--kv-cache-dtype", "bf16"],
    "flag_kernel_given": DECODE_CP + ["--kv-cache-dtype", "fp8_e4m3", "--dsa-decode-backend", "flashmla_sparse"],
    "no_flag": _without(DECODE_CP, "--enable-cp-shared-kv", False) + ["--kv-cache-dtype", "fp8_e4m3"],
}


def _dcp_overrides(model_dir: str) -> dict:
    """What ``_dsa_dcp_overrides`` returns (or raises) for each of ``OVERRIDE_CASES`` (the function the
    DeepSeek family's override step calls, as the hook installed it)."""
    from sglang.srt.arg_groups.model_overrides import deepseek_v2
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    out = {}
    for name, argv in OVERRIDE_CASES.items():
        server_args = prepare_server_args(["--model-path", os.path.join(model_dir, "dsa")] + argv)
        try:
            out[name] = {"overrides": deepseek_v2._dsa_dcp_overrides(resolving_view(server_args))}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    write_model_dirs(root)
    return run_worker([__file__, str(root)], {**os.environ, "SGLANG_PLUGINS": "cp_shared_kv"}, 240)


@pytest.mark.parametrize("case_id,model,mode,argv,expected", CASES, ids=[c[0] for c in CASES])
def test_startup_check(results, case_id, model, mode, argv, expected):
    got = results[case_id]
    if expected is None:
        assert got["accepted"], got.get("error")
        return
    assert not got["accepted"], f"{case_id} was accepted"
    error = got["error"]
    assert error.startswith("CPSharedKVStartupError: --enable-cp-shared-kv: "), error
    lines = error[len("CPSharedKVStartupError: ") :].split("\n")
    assert all(line.startswith("--enable-cp-shared-kv: ") and line.endswith(".") for line in lines), lines
    assert all(line.count("--enable-cp-shared-kv: ") == 1 and not line.endswith("..") for line in lines), lines
    assert any(expected in line for line in lines), f"no line names {expected!r}: {lines}"


def test_sglang_dsa_dcp_overrides_on_a_decode_cp_server(results):
    """With the flag, SGLang's DSA DCP overrides admit PD on the decode and pick FlashMLA's decode kernel for
    the cache (SGLang's default, trtllm, is SM100's); a kernel given stays; without the flag SGLang's own
    refusal of PD stands."""
    got = results["_overrides"]
    assert got["flag_fp8"] == {"overrides": {"dsa_decode_backend": "flashmla_kv"}}, got
    assert got["flag_bf16"] == {"overrides": {"dsa_decode_backend": "flashmla_sparse"}}, got
    assert got["flag_kernel_given"] == {"overrides": {}}, got
    assert "DSA DCP does not support PD disaggregation" in got["no_flag"]["error"], got


def test_each_rejection_is_alone_in_its_case(results):
    """A case with one bad flag gets exactly one line (no collateral rejections hide which flag is wrong)."""
    # These legitimately bring more than one line (a CPU device, or several bad settings).
    multi = {"cpu_device", "dummy_model", "cp_resolves_to_1", "no_attn_cp_size", "bad_settings"}
    for case_id, _, _, _, expected in CASES:
        if expected is None or case_id in multi:
            continue
        lines = results[case_id]["error"].split("\n")
        assert len(lines) == 1, (case_id, lines)


def test_an_attention_cp_size_sglang_sets_itself_is_not_refused(results):
    """Without --attn-cp-size SGLang gives a DeepSeek model --tp-size / --attn-dp-size CP ranks: only the CPU
    device is refused; with --attn-dp-size 8 of 8 it resolves to 1, and the line names the flags that set it."""
    assert "nothing to shard over" not in results["no_attn_cp_size"]["error"], results["no_attn_cp_size"]
    line = [x for x in results["cp_resolves_to_1"]["error"].split("\n") if "nothing to shard over" in x]
    assert len(line) == 1 and "resolves to 1 (--tp-size 8, --attn-dp-size 8)" in line[0], line


def test_each_bad_setting_is_a_line_of_its_own(results):
    lines = results["bad_settings"]["error"].split("\n")
    assert len(lines) == 3 and all(any(name in x for x in lines) for name in CASE_ENV["bad_settings"]), lines


def test_another_sglang_version_names_both_versions_and_the_override(results):
    error = results["other_sglang_version"]["error"]
    assert "SGLang 0.5.24 is installed" in error and "private functions of SGLang 0.5.23 only" in error, error
    assert "install sglang==0.5.23, or set SGLANG_CP_SHARED_KV_ANY_SGLANG=1" in error, error


if __name__ == "__main__":
    _worker(sys.argv[1])
