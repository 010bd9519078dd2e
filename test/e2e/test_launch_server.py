"""``python -m sglang.launch_server --enable-cp-shared-kv`` on the CPU: how far SGLang's real server gets.

SGLang's own launcher, tokenizer manager, scheduler processes, model loader, KV cache configurator and
Mooncake bootstrap run a tiny random-weight DeepSeek-V3.2-shaped model (``demo.sglang_parts.MODELS["dsa"]``
with DeepSeek's YaRN rope scaling, ``--load-format dummy``) as a PD prefill server with prefill CP 2
(``CP_SHARED_KV_E2E_CP`` sets another), with and without the flag, and beside a decode server, on the
test-only platform of ``cpu_platform/`` (its ``STAND_INS`` table names everything it changes). The
servers run in their own process groups; nothing here imports the server.

Reached (asserted), with the platform's stand-ins for the CUDA-only DSA pieces (the indexer's DeepGEMM
logits, FlashMLA's sparse attention by the project's oracle ``reference.dsa_reference.sparse_mla``, for
prefill and decode alike):

- the prefill server with the flag starts; each CP rank's scheduler builds the plugin's pool and allocator
  and logs its line; ``/metrics`` carries the plugin's series per CP rank;
- a 2048-token ``/generate`` runs as 8 chunked-prefill batches on both CP ranks (the later chunks read
  their prefix through the plugin's views: bytes received on every rank, no slot overflow), then a second
  prompt sharing its first 1536 tokens; the same two requests on the same server without the flag (SGLang's
  stock pool, none of the series) give the same token and the same log-probability at every prompt
  position, bit for bit;
- a non-CP decode server with the flag beside the prefill: a request sent to both with one bootstrap room,
  as SGLang's router sends it, is prefilled, its pages go from both CP ranks over Mooncake on 127.0.0.1,
  the decode accepts both ranks' manifests and decodes 8 tokens: the same tokens and log-probabilities as
  the same pair without the flag (SGLang's stock prefill and decode);
- then a second request through the pair sharing the first's first 1536 tokens: the prefill's radix
  cache matches them (``#cached-token: 1536`` in SGLang's batch log), the CP ranks read that prefix
  through the views, and the decoded tokens and log-probabilities equal the stock pair's;
- the decode killed mid-request (its process group, while it generates): its client gets its answer at
  once (the connection closes), not a hang, and the prefill serves the next request;
- a decode CP server (``--tp-size 2 --dcp-size 2``, the flag) beside the prefill: each decode rank builds
  the pool sharded by page ownership under SGLang's DCP allocator, takes the pages it owns from both
  prefill ranks, and decodes 8 tokens through SGLang's DCP path (the plugin's top-k over the ranks, each
  rank's FlashMLA stand-in over its own rows, SGLang's LSE merge), every step checked in debug mode
  against the replicated top-k and attention. Its tokens are not compared with a replicated decode's:
  the random model turns the merge's bf16 rounding into other top-k picks at the next layer.

Not reached: on the prefill server alone (SGLang's fake transfer) the second prompt's prefix is not
matched (``#cached-token: 0``); SGLang's router (not installed here: the test sends to both servers
itself, as the router does).

Selected out of the default run (marker ``e2e``; about 4-7 minutes on 2 cores; it needs SGLang's HTTP
server stack, ``test/e2e/requirements.txt``, which the project's requirements leave out);
``docs/usage.md`` ("What has run through the real launcher") has the command.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import threading
import time

import pytest
from launcher import FAKE_BOOTSTRAP_HOST, Server, free_port, missing_server_stack, register_platform, server_env

from demo.sglang_parts import MODELS, decode_argv, prefill_cp_argv

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.mooncake]

CP = int(os.environ.get("CP_SHARED_KV_E2E_CP", "2"))  # prefill CP ranks (each a scheduler process)
PAGE = 64
CHUNK = 256  # a 2048-token prompt is 8 chunked-prefill batches
SLOTS = 8192  # --max-total-tokens: token slots each CP rank's pool holds
PROMPT = 2048
READY_S = 210 * CP  # CP scheduler processes importing SGLang on 2 shared cores
ANSWER_S = 150 * CP  # a request on CP ranks sharing 2 cores
SHARED = 1536  # the second prompt's prefix shared with the first
DECODE_TOKENS = 8
DCP = 2  # decode CP ranks of the decode CP server
# SGLang's own flags for a CPU server: the torch top-k (the platform sets SGLANG_DSA_FUSE_TOPK=0) and no
# overlap scheduling (its early KV send records a CUDA event).
CPU_FLAGS = ["--dsa-topk-backend", "torch", "--disable-overlap-schedule"]
# What each prefill server answered, by flag: compared across the two classes.
ANSWERS: dict[bool, dict[str, dict]] = {}


def _dsa_model(root) -> str:
    """The demo's tiny DSA config with DeepSeek-V3.2's YaRN rope (SGLang's CPU rope requires deepseek_yarn)."""
    cfg = dict(MODELS["dsa"])
    cfg["n_routed_experts"] = max(cfg["n_routed_experts"], CP)  # SGLang's MoE tensor parallel: an expert per rank
    n = cfg["max_position_embeddings"]
    cfg["rope_scaling"] = {
        "type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": n,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    model = root / "dsa"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    return str(model)


def _prefill_argv(model: str, bootstrap_port: int, flag: bool) -> list[str]:
    argv = prefill_cp_argv(str(model), PAGE, CP)
    argv[argv.index("--model-path") + 1] = model
    argv += ["--load-format", "dummy", "--attention-backend", "dsa", "--max-total-tokens", str(SLOTS)]
    argv += ["--context-length", "4096", "--chunked-prefill-size", str(CHUNK), "--mem-fraction-static", "0.05"]
    argv += ["--disaggregation-bootstrap-port", str(bootstrap_port), "--enable-metrics", "--skip-server-warmup"]
    return argv + CPU_FLAGS + (["--enable-cp-shared-kv"] if flag else [])


def _decode_argv(model: str, flag: bool, tp: int = 1, dcp: int = 1) -> list[str]:
    argv = decode_argv(str(model), PAGE) + ["--tp-size", str(tp)]
    if dcp > 1:  # decode context parallel: DCP ranks within the TP ranks
        argv += ["--dcp-size", str(dcp)]
    argv[argv.index("--model-path") + 1] = model
    argv += ["--load-format", "dummy", "--attention-backend", "dsa", "--max-total-tokens", str(SLOTS)]
    argv += ["--context-length", "4096", "--mem-fraction-static", "0.05", "--enable-metrics", "--skip-server-warmup"]
    # Decode attention by the same sparse MLA as prefill (SGLang's bf16 default, fa3, has no CPU stand-in).
    argv += ["--dsa-decode-backend", "flashmla_sparse"]
    return argv + CPU_FLAGS + (["--enable-cp-shared-kv"] if flag else [])


def _series(metrics: str, name: str) -> dict[int, float]:
    """``cp_rank`` -> value of one plugin series in a Prometheus text page."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            rank = re.search(r'cp_rank="(\d+)"', labels)
            out[int(rank.group(1))] = float(value)
    return out


def _servers(tmp_path_factory, name: str, *, flag: bool, decode: bool = False, tp: int = 1, dcp: int = 1):
    """Starts a prefill server (CP ``CP`` ranks), and first a decode server when ``decode``; yields (prefill,
    decode or None)."""
    missing = missing_server_stack()
    if missing:
        pytest.skip(
            f"SGLang's HTTP server stack is not importable ({', '.join(missing)}): "
            "pip install --no-deps -r test/e2e/requirements.txt (or --target DIR and CP_SHARED_KV_E2E_SITE=DIR)"
        )
    root = tmp_path_factory.mktemp(name)
    # One OpenMP bind group per CP rank, over the two cores.
    binds = "|".join(str(rank % 2) for rank in range(CP))
    env = server_env(register_platform(root / "registry"), SGLANG_CPU_OMP_THREADS_BIND=binds)
    model = _dsa_model(root)
    started = []
    try:
        dec = None
        if decode:
            # The decode's debug log names each request whose manifests it accepted (no device syncs there).
            dec_env = {**env, "SGLANG_DEBUG_CP_SHARED_KV": "1"}
            dec = Server(_decode_argv(model, flag, tp, dcp), dec_env, root / "decode.log", free_port())
            started.append(dec)
            dec.ready_s = dec.wait_ready(READY_S)
        bootstrap_port = free_port()
        pre = Server(_prefill_argv(model, bootstrap_port, flag), env, root / "prefill.log", free_port())
        pre.bootstrap_port = bootstrap_port
        started.append(pre)
        pre.ready_s = pre.wait_ready(READY_S)
        yield pre, dec
    finally:
        for server in reversed(started):
            server.stop()


def _prompt(n: int = PROMPT) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(1, MODELS["dsa"]["vocab_size"]) for _ in range(n)]


def _prompts() -> dict[str, list[int]]:
    """A prompt of several chunks, and a second one sharing its first ``SHARED`` tokens."""
    first = _prompt()
    rng = random.Random(1)
    second = first[:SHARED] + [rng.randrange(1, MODELS["dsa"]["vocab_size"]) for _ in range(PROMPT - SHARED)]
    return {"first": first, "second": second}


def _generate(server: Server, prompt: list[int], room: int, bootstrap: dict | None = None) -> dict:
    """One prefill request: its first token with the log-probabilities of every prompt position."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "bootstrap_room": room,
        **(bootstrap or {"bootstrap_host": FAKE_BOOTSTRAP_HOST}),  # alone: SGLang's fake transfer
    }
    t0 = time.monotonic()
    status, text = server.post("/generate", body, timeout_s=ANSWER_S)
    assert status == 200, (status, text[:500], server.tail(60))
    out = json.loads(text)
    out["seconds"] = time.monotonic() - t0
    return out


def _compared(answer: dict) -> dict:
    """What must be equal with and without the flag: the token and every log-probability SGLang returned."""
    meta = answer["meta_info"]
    return {
        "output_ids": answer["output_ids"],
        "input_token_logprobs": meta["input_token_logprobs"],
        "output_token_logprobs": meta["output_token_logprobs"],
        "output_top_logprobs": meta["output_top_logprobs"],
    }


def _serve_both_prompts(server: Server, flag: bool) -> None:
    answers = {}
    for room, (name, prompt) in enumerate(_prompts().items(), start=1):
        answer = _generate(server, prompt, room)
        meta = answer["meta_info"]
        assert meta["prompt_tokens"] == PROMPT and len(answer["output_ids"]) == 1
        # One log-probability per prompt position after the first, each a real number.
        logprobs = [lp for lp, _tok, _ in meta["input_token_logprobs"] if lp is not None]
        assert len(logprobs) == PROMPT - 1 and all(math.isfinite(lp) and lp < 0 for lp in logprobs)
        answers[name] = answer
    # Chunked prefill of a prompt of PROMPT tokens in chunks of CHUNK: one batch per chunk, every one on
    # each CP rank.
    assert server.text().count("Prefill batch") >= 2 * PROMPT // CHUNK
    ANSWERS[flag] = answers


class TestWithTheFlag:
    @pytest.fixture(scope="class")
    @classmethod
    def prefill(cls, tmp_path_factory):
        for prefill, _ in _servers(tmp_path_factory, "flag", flag=True):
            yield prefill

    def test_prefill_cp_starts_through_the_launcher(self, prefill):
        log = prefill.text()
        for rank in range(CP):
            # The plugin's hooks built this rank's pool and allocator inside SGLang's scheduler process.
            line = re.search(
                rf"--enable-cp-shared-kv: CP rank {rank} of {CP}: holds 1/{CP} of every KV page, "
                r"(\d+) token slots for (\d+) logical tokens",
                log,
            )
            assert line, f"rank {rank}'s startup line is missing:\n{prefill.tail()}"
            assert (int(line.group(1)), int(line.group(2))) == (SLOTS, CP * SLOTS)
        assert log.count("--enable-cp-shared-kv: Mooncake transfers send each CP rank's owned pages") == CP
        assert f"max_total_num_tokens={SLOTS}," in log
        metrics = prefill.get("/metrics")
        held = _series(metrics, "sglang:cp_shared_kv_held_tokens")
        logical = _series(metrics, "sglang:cp_shared_kv_logical_capacity_tokens")
        arena = _series(metrics, "sglang:cp_shared_kv_view_arena_bytes")
        assert held == {r: float(SLOTS) for r in range(CP)}, metrics
        assert logical == {r: float(CP * SLOTS) for r in range(CP)}
        assert set(arena) == set(range(CP)) and len(set(arena.values())) == 1 and min(arena.values()) > 0

    def test_generate_of_several_chunks_then_a_prompt_sharing_its_prefix(self, prefill):
        _serve_both_prompts(prefill, flag=True)
        metrics = prefill.get("/metrics")
        # The chunks after the first read their prefix through the plugin's views: each rank received the
        # other's pages of it (over gloo here), and no batch overflowed an owner's block.
        received = _series(metrics, "sglang:cp_shared_kv_view_bytes_received_total")
        assert set(received) == set(range(CP)) and min(received.values()) > 0, received
        assert 'transport="gloo"} 1.0' in metrics
        overflows = _series(metrics, "sglang:cp_shared_kv_slot_overflows_total")
        assert all(v == 0 for v in overflows.values()), overflows


class TestWithoutTheFlag:
    """The same server without the flag: SGLang's stock pool, no plugin series, the same stop."""

    @pytest.fixture(scope="class")
    @classmethod
    def prefill(cls, tmp_path_factory):
        for prefill, _ in _servers(tmp_path_factory, "stock", flag=False):
            yield prefill

    def test_prefill_cp_starts_with_the_stock_pool(self, prefill):
        log = prefill.text()
        assert "--enable-cp-shared-kv:" not in log
        assert f"max_total_num_tokens={SLOTS}," in log
        assert "cp_shared_kv" not in prefill.get("/metrics")

    def test_generate_gives_the_same_tokens_and_logprobs(self, prefill):
        _serve_both_prompts(prefill, flag=False)
        if True not in ANSWERS:
            pytest.fail("the server with the flag answered nothing to compare with (see TestWithTheFlag)")
        for name in ("first", "second"):
            assert _compared(ANSWERS[True][name]) == _compared(ANSWERS[False][name]), name


PD_ANSWERS: dict[tuple[bool, str], dict] = {}  # by flag and prompt


def _second_pd_request(prefill: Server, decode: Server, flag: bool) -> None:
    """After the first request's pages went to the decode, the second prompt (its first ``SHARED`` tokens the
    first's): SGLang's radix cache on the prefill matches them, and the decode's tokens are compared."""
    if (flag, "first") not in PD_ANSWERS:
        pytest.fail("the first request through the pair answered nothing")
    _, _, answer = _pd_request(prefill, decode, room=10, max_new_tokens=DECODE_TOKENS, prompt=_prompts()["second"])
    # SGLang's batch log: the prefix came from the radix cache (whole pages), the rest was prefilled.
    assert f"#cached-token: {SHARED // PAGE * PAGE}" in prefill.text(), prefill.tail(40)
    PD_ANSWERS[flag, "second"] = _decoded(answer)
    assert len(PD_ANSWERS[flag, "second"]["output_ids"]) == DECODE_TOKENS


def _pd_request(prefill: Server, decode: Server, room: int, max_new_tokens: int, wait: bool = True, prompt=None):
    """A request sent to both servers with one bootstrap room, as SGLang's router sends it (``prompt``: the
    first of ``_prompts`` by default).

    Returns the prefill's (status, body, seconds) and the decode's client thread with its answer dict.
    """
    body = {
        "input_ids": prompt or _prompt(),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        "return_logprob": True,
        "top_logprobs_num": 3,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }
    answer = {}

    def ask() -> None:
        t0 = time.monotonic()
        status, text = decode.post("/generate", body, timeout_s=ANSWER_S)
        answer.update(status=status, text=text, seconds=time.monotonic() - t0, done=time.monotonic())

    to_decode = threading.Thread(target=ask, daemon=True)
    to_decode.start()
    time.sleep(1)  # the decode registers the room with the prefill's bootstrap server first
    t0 = time.monotonic()
    status, text = prefill.post("/generate", body, timeout_s=ANSWER_S)
    assert status == 200, (status, text[:300], prefill.tail(40))
    assert json.loads(text)["meta_info"]["prompt_tokens"] == PROMPT
    if wait:
        to_decode.join(ANSWER_S + 30)
        assert not to_decode.is_alive(), "the decode's client hung"
    return (status, text, time.monotonic() - t0), to_decode, answer


def _decoded(answer: dict) -> dict:
    assert answer["status"] == 200, (answer["status"], answer["text"][:500])
    out = json.loads(answer["text"])
    meta = out["meta_info"]
    return {
        "output_ids": out["output_ids"],
        "output_token_logprobs": meta["output_token_logprobs"],
        "output_top_logprobs": meta["output_top_logprobs"],
    }


class TestPDWithoutTheFlag:
    """The same pair without the flag: SGLang's stock prefill and decode, the reference for the tokens."""

    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls, tmp_path_factory):
        yield from _servers(tmp_path_factory, "pd_stock", flag=False, decode=True)

    def test_a_request_through_prefill_and_decode(self, servers):
        prefill, decode = servers
        _, _, answer = _pd_request(prefill, decode, room=7, max_new_tokens=DECODE_TOKENS)
        PD_ANSWERS[False, "first"] = _decoded(answer)
        assert len(PD_ANSWERS[False, "first"]["output_ids"]) == DECODE_TOKENS

    def test_a_second_request_reads_its_prefix_from_the_radix_cache(self, servers):
        _second_pd_request(*servers, flag=False)


class TestPDWithTheFlag:
    """A decode server (non-CP, the flag on: it expects the prefill ranks' manifests) and the CP prefill server,
    a request sent to both as SGLang's router sends it (the same bootstrap room)."""

    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls, tmp_path_factory):
        yield from _servers(tmp_path_factory, "pd", flag=True, decode=True)

    def test_decode_with_the_flag_starts_with_the_stock_pool(self, servers):
        _, decode = servers
        log = decode.text()
        assert "CP rank" not in log and f"max_total_num_tokens={SLOTS}," in log
        assert "sglang:cp_shared_kv_held_tokens" not in decode.get("/metrics")

    def test_a_request_through_prefill_and_decode(self, servers):
        prefill, decode = servers
        _, _, answer = _pd_request(prefill, decode, room=7, max_new_tokens=DECODE_TOKENS)
        # The decode server checked both prefill CP ranks' page manifests (SGLang's Mooncake connector over
        # 127.0.0.1) before the request was ready: its debug log line.
        log = decode.text()
        assert f"--enable-cp-shared-kv: room 7: {CP} manifests cover its {PROMPT // PAGE} pages" in log, decode.tail(60)
        assert "manifest check failed" not in log
        decoded = PD_ANSWERS[True, "first"] = _decoded(answer)
        assert len(decoded["output_ids"]) == DECODE_TOKENS
        if (False, "first") not in PD_ANSWERS:
            pytest.fail("the pair without the flag answered nothing to compare with (see TestPDWithoutTheFlag)")
        assert decoded == PD_ANSWERS[False, "first"]

    def test_a_second_request_reads_its_prefix_from_the_radix_cache(self, servers):
        # The prefix's pages, matched in the radix cache, are read through the views of the CP ranks that
        # own them, under the shared-prefix hint; the decode's tokens equal the stock pair's.
        _second_pd_request(*servers, flag=True)
        if (False, "second") not in PD_ANSWERS:
            pytest.fail("the pair without the flag answered nothing to compare with (see TestPDWithoutTheFlag)")
        assert PD_ANSWERS[True, "second"] == PD_ANSWERS[False, "second"]

    def test_killing_the_decode_mid_request(self, servers):
        prefill, decode = servers
        _, to_decode, answer = _pd_request(prefill, decode, room=8, max_new_tokens=2000, wait=False)
        time.sleep(2)  # the pages are sent (the prefill answered); the decode is generating
        assert to_decode.is_alive(), f"the decode finished 2000 tokens already: {answer}"
        killed = time.monotonic()
        decode.stop()
        to_decode.join(60)
        # The decode's client gets its answer at once (the connection closes), not a hang.
        assert not to_decode.is_alive(), "the decode's client hung after the decode was killed"
        assert answer["status"] != 200 and answer["done"] - killed < 30, answer
        # The prefill server lives on and serves the next request.
        assert prefill.proc.poll() is None
        status, text = prefill.post(
            "/generate",
            {
                "input_ids": _prompt(256),
                "sampling_params": {"max_new_tokens": 1},
                "bootstrap_host": FAKE_BOOTSTRAP_HOST,
                "bootstrap_room": 9,
            },
            timeout_s=ANSWER_S,
        )
        assert status == 200, (status, text[:300], prefill.tail(40))


class TestPDIntoDecodeCP:
    """The CP prefill with the flag into a decode CP server (``--tp-size 2 --dcp-size 2``, the flag): each
    decode rank builds the pool sharded by page ownership over the DCP ranks, takes the pages it owns from
    both prefill CP ranks (routed by the prefill), and decodes through SGLang's DCP path: the indexer's
    top-k from each rank's own keys merged over the ranks, each rank's attention over its own rows,
    SGLang's LSE merge. The decode runs in debug mode: every step's top-k and attention, per layer and
    rank, are checked in the server against the replicated ones (the scores and rows gathered from their
    owners); a mismatch stops it."""

    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls, tmp_path_factory):
        yield from _servers(tmp_path_factory, "pd_dcp", flag=True, decode=True, tp=DCP, dcp=DCP)

    def test_each_decode_rank_builds_the_sharded_pool(self, servers):
        _, decode = servers
        log = decode.text()
        for rank in range(DCP):
            line = (
                f"--enable-cp-shared-kv: decode CP pool, rank {rank} of {DCP}: {SLOTS} latent and indexer rows "
                f"here, {DCP * SLOTS} tokens across the ranks"
            )
            assert line in log, decode.tail(60)

    def test_a_request_through_prefill_and_decode_cp(self, servers):
        prefill, decode = servers
        _, _, answer = _pd_request(prefill, decode, room=7, max_new_tokens=DECODE_TOKENS)
        log = decode.text()
        # Each decode rank accepted both prefill ranks' manifests, routed by its DCP size.
        assert log.count(f"--enable-cp-shared-kv: room 7: {CP} manifests cover its {PROMPT // PAGE} pages") == DCP
        assert "manifest check failed" not in log
        checked = "--enable-cp-shared-kv: debug mode: every decode CP step's top-k and attention are checked"
        assert log.count(checked) == DCP, decode.tail(60)
        decoded = _decoded(answer)
        assert len(decoded["output_ids"]) == DECODE_TOKENS
        assert all(math.isfinite(lp) and lp < 0 for lp, _tok, _ in decoded["output_token_logprobs"])
