"""What the demo can run, checked in the driver before any rank starts (torch-free, except the settings check).

Each check raises ``Refusal`` with one line that names the option to change and a value that runs; the
driver prints it as ``error: <line>`` and exits with code 2, within a few seconds, before SGLang is imported.
"""

from __future__ import annotations

import resource

# SGLang's DSA pool (``DSATokenToKVPool``) stores 64-token pages only: it asserts this page size.
PAGE_SIZE = 64
# Each further request is this many tokens longer than the one before (the requests' last pages differ).
STRIDE = 7
# The demo's context length goes up in steps of this many tokens.
CONTEXT_STEP = 256
# Open files: the driver (the decode) holds about 9 per rank (the rank's queue and process sentinel, its
# Mooncake and ZeroMQ connections to the rank) over about 40 of its own; each rank about 40 plus one or two
# per peer (gloo). Measured at CP 4 and 8 (78 and 114 in the driver) and rounded up; the demo's JSON records
# each process's count, and test/demo/test_demo.py holds it to this estimate.
FILES_BASE = 64
FILES_PER_RANK = 12
# Memory: a rank's proportional set size at the default options (torch's, SGLang's and the hooks' imports,
# then its pools): 420-470 MiB measured at CP 4 and 8, rounded up; the pools' share grows with the prompts.
RANK_BYTES = 512 << 20


class Refusal(ValueError):
    """Options the demo cannot run with: one line saying which option to change and to what."""


def request_lengths(request_len: int, requests: int) -> list[int]:
    """The prompt lengths: ``request_len`` for the first request and ``STRIDE`` more for each next one."""
    return [request_len + STRIDE * i for i in range(requests)]


def context_len(longest: int, chunk: int) -> int:
    """The context length the demo gives SGLang (``--context-length``): the longest prompt plus one chunk of
    headroom, rounded up to ``CONTEXT_STEP``. SGLang sizes the view arena and its own page-interleave scratch
    from it, so it stays near the prompts rather than at the model's maximum."""
    return -(-(longest + chunk) // CONTEXT_STEP) * CONTEXT_STEP


def model_context(config: dict) -> int:
    """The context length SGLang derives from a model's ``config.json`` (its ``get_context_length``): the first of
    its context keys, times the rope scaling factor where one applies. ``--context-length`` may not exceed it."""
    scaling = config.get("rope_scaling") or {}
    factor = scaling.get("factor", 1) if scaling else 1
    if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
        factor = 1
    for key in ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings"):
        if config.get(key) is not None:
            return int(factor * config[key])
    return 2048


def check_counts(cp_size: int, requests: int, request_len: int, chunk: int, topk: int) -> None:
    """Every count is positive, and a CP-shared pool spans two ranks or more."""
    if cp_size < 2:
        raise Refusal(f"--cp-size {cp_size}: a CP-shared pool spans two ranks or more: use --cp-size 2 or more")
    for name, value in (("requests", requests), ("request-len", request_len), ("chunk", chunk), ("topk", topk)):
        if value < 1:
            raise Refusal(f"--{name} {value}: use 1 or more")


def check_pages(page_size: int, chunk: int) -> None:
    """64-token pages (SGLang's DSA pool asserts them), and chunks of whole pages (sharded extends start on one)."""
    if page_size != PAGE_SIZE:
        raise Refusal(
            f"--page-size {page_size}: SGLang's DSA pool stores {PAGE_SIZE}-token pages only: use --page-size {PAGE_SIZE}"
        )
    if chunk % page_size:
        raise Refusal(
            f"--chunk {chunk} is not whole {page_size}-token pages: use a multiple of {page_size}, "
            f"e.g. --chunk {max(page_size, chunk // page_size * page_size)}"
        )


def check_context(request_len: int, requests: int, chunk: int, limit: int) -> None:
    """The context the demo asks of SGLang (``context_len``) fits the model's (``limit``): SGLang refuses a longer
    ``--context-length``. The line names the number to lower: ``--request-len``, else ``--chunk``."""
    longest = request_lengths(request_len, requests)[-1]
    need = context_len(longest, chunk)
    if need <= limit:
        return
    what = (
        f"--request-len {request_len}"
        + (f" with --requests {requests}" if requests > 1 else "")
        + f" and --chunk {chunk} need a {need}-token context (the longest prompt, {longest} tokens, plus one chunk, "
        f"rounded up to {CONTEXT_STEP}), and the tiny model's context is {limit} tokens"
    )
    most_len = limit - chunk - STRIDE * (requests - 1)
    if most_len >= 1:
        raise Refusal(f"{what}: use --request-len {most_len} or less")
    most_chunk = (limit - longest) // PAGE_SIZE * PAGE_SIZE
    if most_chunk >= PAGE_SIZE:
        raise Refusal(f"{what}: use --chunk {most_chunk} or less")
    raise Refusal(f"{what}: use fewer --requests")


def check_topk(topk: int, request_len: int, requests: int) -> None:
    """DSA's indexer picks each query's top-k among the keys up to its own position, so no query can fill more
    slots than the longest prompt has tokens; the tiny model's sparse attention still computes every slot
    (the rest padded), so a larger top-k only costs time: it scales with top-k, not with the prompt."""
    longest = request_lengths(request_len, requests)[-1]
    if topk > longest:
        raise Refusal(
            f"--topk {topk} is larger than the longest prompt ({longest} tokens): a query picks its top-k among "
            f"the keys up to its own position, so at most {longest} can be picked: use --topk {longest} or less"
        )


def open_files_limit() -> int:
    """This process's open-file limit, first raised to the hard limit where that is higher (the ranks inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def proc_bytes(path: str, key: str) -> int | None:
    """The ``key: N kB`` line of a Linux ``/proc`` file, in bytes; ``None`` where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int | None:
    """Bytes of memory available for new processes (Linux's ``MemAvailable``); ``None`` where unknown."""
    return proc_bytes("/proc/meminfo", "MemAvailable")


# Decode CP ranks the demo runs (spawned after the prefill ranks exit, torch only).
MAX_DECODE_CP = 8


def check_decode(decode_cp_size: int) -> None:
    """A decode of 1 (every page on it) to ``MAX_DECODE_CP`` ranks (pages sharded by ownership)."""
    if not 1 <= decode_cp_size <= MAX_DECODE_CP:
        raise Refusal(f"--decode-cp-size {decode_cp_size}: use 1 (one decode) to {MAX_DECODE_CP} (decode CP ranks)")


def check_host(cp_size: int, files: int, memory: int | None, decode_cp_size: int = 1) -> None:
    """``cp_size`` ranks and the decode fit this host: its open-file limit (``files``) and available ``memory``.
    Each decode rank past the first counts as a prefill rank (a process with its engine and sockets)."""
    need = FILES_BASE + FILES_PER_RANK * (cp_size + decode_cp_size - 1)
    both = f" with --decode-cp-size {decode_cp_size}" if decode_cp_size > 1 else ""
    if need > files:
        most = (files - FILES_BASE) // FILES_PER_RANK - (decode_cp_size - 1)
        raise Refusal(
            f"--cp-size {cp_size}{both} needs about {need} open files and this process may open {files} (ulimit -n): "
            + (f"use --cp-size {most} or less" if most >= 2 else "raise the open-file limit")
        )
    processes = cp_size + 1 + (decode_cp_size if decode_cp_size > 1 else 0)  # a sharded decode's ranks run apart
    if memory is not None and processes * RANK_BYTES > memory:
        most = memory // RANK_BYTES - 1 - (decode_cp_size if decode_cp_size > 1 else 0)
        raise Refusal(
            f"--cp-size {cp_size}{both} needs about {processes * RANK_BYTES / 2**30:.1f} GiB for its ranks and the decode "
            f"({RANK_BYTES >> 20} MiB each) and {memory / 2**30:.1f} GiB is available: "
            + (f"use --cp-size {most} or less" if most >= 2 else "free some memory")
        )


def check_settings() -> None:
    """The plugin's ``SGLANG_CP_SHARED_KV_*`` settings, read by the server's own startup check (the same line a
    server prints for a bad value). It imports torch (about a second), not SGLang."""
    from sglang_cp_shared_kv.srt.sglang_wiring.startup_checks import _setting_rejections

    lines = _setting_rejections()
    if lines:
        raise Refusal(" ".join(lines))
