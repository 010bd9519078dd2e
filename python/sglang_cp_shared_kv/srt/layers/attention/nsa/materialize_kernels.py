"""Triton kernels of the materialized read path, each beside its plain-torch reference.

- ``gather_page_buffers`` / ``gather_pages``: copy whole pages of page-major pool buffers into a
  send block, in the order a page-id vector gives; one generic copy serves latent and indexer
  pages, and one launch gathers both.
- ``pull_pages``: the whole view of a layer read straight from every owner's pool pages, where the
  peers' pools are mapped into this process (copy-engine transport, views built in line).
- ``positions_to_view_rows``: token positions within a request (NSA top-k output, -1 padded)
  -> rows of a view, ``page_table[req, pos // ps] * ps + pos % ps``; -1 stays -1.
- ``translate_locs``: logical token locs (or page ids) -> rows (pages) of the read buffer, through
  the batch's page map (``plan_kernels.plan_batch``).
- ``PreparedLaunch``: a Triton launch handed straight to the compiled kernel (every kernel here and
  in ``plan_kernels`` launches through it).

Each wrapper runs Triton on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1``
(the tests); otherwise it runs the reference. ``use_triton`` forces either.
None of them reads device data back to the host.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch

from sglang_cp_shared_kv.srt.utils import check_int, current_stream_handle

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on every platform we run
    triton = None


def interpreting() -> bool:
    """Whether this module's kernels were built for the Triton interpreter.

    ``triton.jit`` picks the interpreter when the module is imported with ``TRITON_INTERPRET=1``,
    so that, not the environment at call time, decides whether CPU tensors can run the kernels.
    """
    return triton is not None and not isinstance(_gather_pages_kernel, triton.runtime.JITFunction)


def triton_enabled(device: torch.device, use_triton: bool | None = None) -> bool:
    """Whether a wrapper runs its Triton kernel for tensors on ``device``."""
    runnable = triton is not None and (device.type == "cuda" or interpreting())
    if use_triton is None:
        return runnable
    if use_triton and not runnable:
        raise ValueError(
            f"use_triton=True needs triton and a CUDA device, or TRITON_INTERPRET=1 at import, for {device} tensors"
        )
    return use_triton


def check_index(name: str, t: torch.Tensor, dim: int) -> None:
    """``t`` is an int32 or int64 index tensor of ``dim`` dimensions, else a ``ValueError`` naming it."""
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


# ---------------------------------------------------------------------------------------------
# gather_pages
# ---------------------------------------------------------------------------------------------


def gather_pages_ref(src: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = src[page_ids[i]]`` for a page-major ``src [P, page_bytes]``."""
    if out is None:
        return src.index_select(0, page_ids.long())
    return torch.index_select(src, 0, page_ids.long(), out=out)


if triton is not None:

    @triton.jit
    def _copy_page(src, out, words, BLOCK: tl.constexpr):
        for start in range(0, words, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < words
            tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)

    @triton.jit
    def _gather_pages_kernel(
        page_ids,
        num_slots,
        src_a,
        out_a,
        words_a,
        src_stride_a,
        out_stride_a,
        src_b,
        out_b,
        words_b,
        src_stride_b,
        out_stride_b,
        BLOCK: tl.constexpr,
    ):
        # Program (i, k) copies the pages of slots i, i + G, i + 2G, ... (G programs per column) of
        # buffer a (grid column k = 0) or b (k = 1).
        first = tl.program_id(0).to(tl.int64)
        for slot in range(first, num_slots, tl.num_programs(0)):
            page = tl.load(page_ids + slot).to(tl.int64)
            if tl.program_id(1) == 0:
                _copy_page(src_a + page * src_stride_a, out_a + slot * out_stride_a, words_a, BLOCK)
            else:
                _copy_page(src_b + page * src_stride_b, out_b + slot * out_stride_b, words_b, BLOCK)


def word_view(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a uint8 page buffer as int32 words when rows and base allow it (4x fewer lanes)."""
    if t.dtype == torch.uint8 and t.shape[1] % 4 == 0 and t.stride(0) % 4 == 0 and t.data_ptr() % 4 == 0:
        return t.view(torch.int32)
    return t


def _check_gather(src: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if src.dim() != 2 or src.stride(1) != 1:
        raise ValueError(f"src must be 2-D with contiguous rows, got shape {tuple(src.shape)} strides {src.stride()}")
    if out is None:
        return torch.empty((page_ids.shape[0], src.shape[1]), dtype=src.dtype, device=src.device)
    if out.shape != (page_ids.shape[0], src.shape[1]) or out.dtype != src.dtype or out.stride(1) != 1:
        raise ValueError(
            f"out must be {src.dtype} [{page_ids.shape[0]}, {src.shape[1]}] with contiguous rows, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if page_ids.device != src.device or out.device != src.device:
        raise ValueError(
            f"src, page_ids and out must share a device, got {src.device}, {page_ids.device}, {out.device}"
        )
    return out


def gather_page_buffers(
    srcs: Sequence[torch.Tensor],
    page_ids: torch.Tensor,
    outs: Sequence[torch.Tensor] | None = None,
    use_triton: bool | None = None,
) -> list[torch.Tensor]:
    """Copy the same pages of one or two page-major buffers (``[P, page_bytes]`` each, rows contiguous)
    into ``outs[k][i] = srcs[k][page_ids[i]]``, in one kernel launch.

    The read path gathers a slot's latent page and its indexer page together. ``page_ids`` must
    hold valid page indices of every source (the plan points padding at the trash page).
    """
    outs, launch = prepare_gather(srcs, page_ids, outs, use_triton)
    launch()
    return outs


def prepare_gather(
    srcs: Sequence[torch.Tensor],
    page_ids: torch.Tensor,
    outs: Sequence[torch.Tensor] | None = None,
    use_triton: bool | None = None,
) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """``gather_page_buffers`` checked once: ``(outs, launch)``, where each ``launch()`` queues the same
    gather (these very tensors, on the current stream) without the checks."""
    if not 1 <= len(srcs) <= 2:
        raise ValueError(f"srcs must hold one or two buffers, got {len(srcs)}")
    if outs is not None and len(outs) != len(srcs):
        raise ValueError(f"outs must match srcs ({len(srcs)} buffers), got {len(outs)}")
    check_index("page_ids", page_ids, 1)
    outs = [_check_gather(src, page_ids, None if outs is None else outs[k]) for k, src in enumerate(srcs)]
    if page_ids.shape[0] == 0:
        return outs, _nothing
    if not triton_enabled(srcs[0].device, use_triton):
        pairs = list(zip(srcs, outs))
        return outs, lambda: [gather_pages_ref(src, page_ids, out) for src, out in pairs]
    return outs, gather_launch([word_pair(src, out) for src, out in zip(srcs, outs)], page_ids)


def word_pair(
    src: torch.Tensor, out: torch.Tensor, src_words: torch.Tensor | None = None, out_words: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``src`` and ``out`` as int32 words when both allow it (``word_view``, or the ``word_view`` s a caller
    kept), else both as they are."""
    s_words = word_view(src) if src_words is None else src_words
    o_words = word_view(out) if out_words is None else out_words
    return (s_words, o_words) if s_words.dtype == o_words.dtype else (src, out)


def gather_launch(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    page_ids: torch.Tensor,
    programs: int | None = None,
    like: PreparedLaunch | None = None,
) -> PreparedLaunch:
    """The gather kernel's launch copying ``pairs[k] = (src, out)`` pages ``page_ids`` (one or two pairs,
    ``word_pair`` s of buffers ``prepare_gather`` accepts): its last step, for a caller that built and
    checked the buffers itself (the view materializer, once per layer and batch).

    ``programs``: programs per buffer, each looping over every ``programs``-th slot (None: one per
    slot). Fewer programs hold fewer SMs at once: what a gather running beside other kernels wants.
    ``like``: an earlier launch of this function with the same page ids, outs and ``programs`` (another
    layer's sources into the same view): only the sources' arguments are bound again (``rebind``)."""
    args = [(s, o, s.shape[1], s.stride(0), o.stride(0)) for s, o in pairs]
    a, b = args[0], args[-1]
    slots = page_ids.shape[0]
    grid0 = slots if programs is None else max(1, min(slots, programs))
    if like is not None and like.fn is _gather_pages_kernel and like.args[0] is page_ids:
        old = like.args  # (page_ids, slots, *a, *b): a source's tensor, words, strides at 2-6 and 7-11
        same_outs = old[3] is a[1] and old[8] is b[1] and (old[4], old[6], old[9], old[11]) == (a[2], a[4], b[2], b[4])
        if same_outs and like.grid == (grid0, len(args), 1):
            return like.rebind({2: a[0], 5: a[3], 7: b[0], 10: b[3]})
    block = min(4096, triton.next_power_of_2(max(a[2] for a in args)))
    return PreparedLaunch(
        _gather_pages_kernel,
        (grid0, len(args)),
        (page_ids, slots, *a, *b),
        {"BLOCK": block},
        num_warps=8 if block >= 2048 else 4,
    )


def _nothing() -> None:
    return None


_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None) if triton is not None else None


def _no_launch_hooks() -> bool:
    """Whether Triton has no launch hooks set (none, or hook chains without calls)."""
    runtime = _RUNTIME
    if runtime is None:
        return False
    enter, exit_ = getattr(runtime, "launch_enter_hook", None), getattr(runtime, "launch_exit_hook", None)
    if enter is None and exit_ is None:  # the common case, answered without more lookups (host time)
        return True
    return all(hook is None or not getattr(hook, "calls", True) for hook in (enter, exit_))


def _tensor_key(arg: torch.Tensor) -> tuple[tuple, int]:
    """A tensor's key (its dtype and 16-byte alignment) and its address, from one ``data_ptr`` call."""
    ptr = arg.data_ptr()
    return (arg.dtype, ptr % 16 == 0), ptr


def _specialization(arg) -> tuple:
    """What Triton may specialize a kernel on for one argument, and more: a tensor's dtype and 16-byte
    alignment; an int's being 1, its divisibility by 16 and its width (i32, i64, u64); anything else by
    value. Two argument lists with equal keys select the same compiled kernel."""
    if isinstance(arg, torch.Tensor):
        return _tensor_key(arg)[0]
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return ("i", arg == 1, arg % 16 == 0, -(1 << 31) <= arg < (1 << 31), arg >= (1 << 63))
    return ("v", type(arg), arg)


def _free_specialization(arg) -> tuple:
    """``_specialization`` of an argument the kernel names in ``do_not_specialize``: an int's width only
    (Triton types it, never specializes its value), so a layer index or a length does not change the key."""
    if isinstance(arg, int) and not isinstance(arg, bool):
        return ("n", -(1 << 31) <= arg < (1 << 31), arg >= (1 << 63))
    return _specialization(arg)


def _keyed(keyer, arg, device: int) -> tuple[tuple, object]:
    """``(keyer(arg), what the compiled launcher is handed for arg)``: a tensor goes by its address, read once
    with its alignment. Handed an int, the launcher neither calls ``data_ptr`` nor asks the driver whether the
    pointer is a device one (a driver call per tensor per launch: host time); the launch keeps the tensor
    (``args``) for as long as it holds the address. So the device is checked here, as an int: a tensor must be
    on the launch's ``device`` (``get_device()``: -1 for the host), or pinned host memory, which a CUDA kernel
    reaches through unified addressing."""
    if isinstance(arg, torch.Tensor):
        where = arg.get_device()
        if where != device and not (where < 0 and arg.is_pinned()):
            on = "the host" if device < 0 else f"cuda:{device}"
            raise ValueError(
                f"a kernel launched on {on} got a tensor on {arg.device}: its arguments must be on the launch's "
                "device (or pinned host memory)"
            )
        return _tensor_key(arg)
    return keyer(arg), arg


def _specializers(fn, count: int) -> tuple:
    """Per argument of ``fn`` (its first ``count``), the function that keys it."""
    params = list(getattr(fn, "params", ()))[:count]
    free = [bool(getattr(p, "do_not_specialize", False)) for p in params]
    free += [False] * (count - len(free))
    return tuple(_free_specialization if f else _specialization for f in free)


# Compiled kernels by (kernel, device, options, constexprs, specialization of every argument).
_COMPILED: dict[tuple, object] = {}
_COMPILED_LIMIT = 256


class GraphKey:
    """A launch's ``graph_key`` value with its hash kept: a dict of captured graphs looks it up per batch."""

    __slots__ = ("value", "args", "_hash")

    def __init__(self, value: tuple, args: tuple):
        self.value, self.args, self._hash = value, args, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, GraphKey) and self._hash == other._hash and self.value == other.value
        )


class PreparedLaunch:
    """One Triton launch with fixed arguments, queued on every call (on the current stream).

    Triton's JIT spends tens of µs of host time per launch binding and specializing the arguments
    and looking the kernel up (``docs/benchmarks/host_calls.json``). Here the first launch of a
    specialization goes through the JIT, which compiles or finds the kernel; it is kept under a key
    (``_specialization`` of every argument, a superset of what Triton specializes on; an int the kernel
    names in ``do_not_specialize`` by its width alone), and every later launch with an equal key, this
    one's or another's, hands the arguments straight to that compiled kernel's launcher, tensors as their
    addresses (``_keyed``). ``constexprs`` must be the kernel's last parameters, in signature order (the
    launcher takes them after ``args``; checked once per kernel). Under the interpreter, or while
    Triton's launch hooks are set (profilers), every launch goes through the JIT. The kernel found is
    kept on the instance until an argument's specialization changes.
    """

    def __init__(self, fn, grid: tuple[int, ...], args: tuple, constexprs: dict, **options):
        self.fn, self.args, self.constexprs, self.options = fn, args, constexprs, options
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        # The launch's device: its first tensor's, or the first one's off the host (pinned host memory may come
        # first); the index kept as an int (host time).
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        first = next((a for a in tensors if a.get_device() >= 0), tensors[0])
        self.device, self._device_index = first.device, first.get_device()
        self._constants = tuple(constexprs.values())
        self._keyers = _specializers(fn, len(args))
        keyed = [_keyed(key, a, self._device_index) for key, a in zip(self._keyers, args)]
        self._spec = tuple(k for k, _ in keyed)
        # What the compiled launcher is handed: tensors by address (``_keyed``), then the constexprs.
        self._all_args = (*(raw for _, raw in keyed), *self._constants)
        self._key = (fn, self.device, tuple(sorted(options.items())), tuple(constexprs.items()), self._spec)
        self._kernel = None
        self._graph_key: GraphKey | None = None

    def __call__(self) -> None:
        kernel = self._kernel or _COMPILED.get(self._key)
        if kernel is None or not _no_launch_hooks():
            kernel = self.fn[self.grid](*self.args, **self.constexprs, **self.options)
            if self._direct_launch_fits(kernel):
                if len(_COMPILED) >= _COMPILED_LIMIT:
                    _COMPILED.clear()
                _COMPILED[self._key] = kernel
            return
        self._kernel = kernel
        g0, g1, g2 = self.grid
        stream = current_stream_handle(self.device)
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *self._all_args)

    def compiled(self):
        """The compiled kernel this launch runs directly, or None where its next launch goes through the JIT
        (not yet compiled, under the interpreter, or with launch hooks set)."""
        kernel = self._kernel or _COMPILED.get(self._key)
        return kernel if kernel is not None and _no_launch_hooks() else None

    def launch_on(self, stream: int) -> None:
        """Queue this launch on raw stream ``stream`` through its compiled kernel (``compiled()``), for a
        caller that captures it into a graph."""
        kernel = self._kernel = self.compiled()
        if kernel is None:
            raise RuntimeError("launch_on needs a compiled kernel (compiled() is None)")
        g0, g1, g2 = self.grid
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *self._all_args)

    def graph_key(self) -> GraphKey:
        """What a captured launch bakes in: the compiled kernel's key, the grid and every argument's value; the
        same object while the arguments are (host time: hashed once)."""
        key = self._graph_key
        if key is None or key.args is not self._all_args:
            key = self._graph_key = GraphKey((self._key, self.grid, self._all_args), self._all_args)
        return key

    def set_free_int(self, index: int, value: int) -> None:
        """``set_args({index: value})`` for an int the kernel names in ``do_not_specialize`` (a layer index):
        where it keys as the one it replaces (the same width), only that argument changes (host time)."""
        if self._keyers[index] is not _free_specialization or _free_specialization(value) != self._spec[index]:
            self._bind({index: value})
            return
        args, raw = self.args, self._all_args
        self.args = (*args[:index], value, *args[index + 1 :])
        self._all_args = (*raw[:index], value, *raw[index + 1 :])

    def relaunch(self, grid: tuple[int, ...], args: tuple, queue: bool = True) -> None:
        """Queue this launch again with a new grid and ``args`` (on the same device; ``queue=False``: bind them
        only). An argument that is the very object the last launch had (a pool buffer, a reused workspace), at
        the same address, keeps its key, as does an int equal to the last one (host time: a batch's launch
        changes a few of its arguments)."""
        spec, raw, old = list(self._spec), list(self._all_args), self.args
        for i, a in enumerate(args):
            b = old[i]
            if a is b or (type(a) is int and type(b) is int and a == b):
                if not isinstance(a, torch.Tensor) or a.data_ptr() == raw[i]:
                    continue
            spec[i], raw[i] = _keyed(self._keyers[i], a, self._device_index)
        self._rekey(tuple(spec))
        self.args, self._all_args = args, tuple(raw)
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        if queue:
            self()

    def rebind(self, changes: dict[int, object]) -> PreparedLaunch:
        """This launch with ``args[i]`` replaced by ``changes[i]``; the kernel-cache key is kept where every
        new argument keys as the one it replaces, else computed again."""
        new = copy.copy(self)
        new._bind(changes)
        return new

    def set_args(self, changes: dict[int, object]) -> None:
        """``rebind(changes)`` in place, for a caller that owns this launch (no copy: host time)."""
        self._bind(changes)

    def _bind(self, changes: dict[int, object]) -> None:
        args, spec, raw = list(self.args), list(self._spec), list(self._all_args)
        for i, arg in changes.items():
            args[i] = arg
            spec[i], raw[i] = _keyed(self._keyers[i], arg, self._device_index)
        self.args, self._all_args = tuple(args), tuple(raw)
        self._rekey(tuple(spec))

    def _rekey(self, spec: tuple) -> None:
        """The arguments now key as ``spec``: a new kernel-cache key, and the kept kernel dropped if it changed."""
        if spec != self._spec:
            self._spec, self._kernel = spec, None
            self._key = (*self._key[:4], spec)

    def _direct_launch_fits(self, kernel) -> bool:
        """Whether a compiled kernel's launcher can take this launch's arguments as laid out here."""
        names = list(getattr(self.fn, "arg_names", ()))
        ordered = names == [*names[: len(self.args)], *self.constexprs] and len(names) == len(self._all_args)
        return ordered and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata"))


# One ``PreparedLaunch`` per launch site of ``launch``: kernel, constexprs, options and device.
_SITES: dict[tuple, PreparedLaunch] = {}


def launch(fn, grid: tuple[int, ...], args: tuple, constexprs: dict, queue: bool = True, **options) -> PreparedLaunch:
    """``fn[grid](*args, **constexprs, **options)`` through ``PreparedLaunch``'s kernel cache, each site's
    launch kept and relaunched with the new arguments (host time: no key built per call). Returns the site's
    launch; ``queue=False`` binds the arguments without queueing it (the caller does: ``launch_on`` inside a
    captured graph, else a call)."""
    device = args[0].device if isinstance(args[0], torch.Tensor) else None
    # The kernel by identity: its hash is its source's (host time). A kept site holds the kernel, so no other
    # object takes its id.
    site = (id(fn), device, *constexprs.items(), *options.items())
    prepared = _SITES.get(site)
    if prepared is None or prepared.device != device or prepared.fn is not fn:
        if len(_SITES) >= _COMPILED_LIMIT:
            _SITES.clear()
        prepared = _SITES[site] = PreparedLaunch(fn, grid, args, constexprs, **options)
        if queue:
            prepared()
        return prepared
    prepared.relaunch(grid, args, queue)
    return prepared


def gather_pages(
    src: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None, use_triton: bool | None = None
) -> torch.Tensor:
    """Copy ``src[page_ids[i]]`` into ``out[i]``: ``gather_page_buffers`` for a single buffer."""
    return gather_page_buffers([src], page_ids, None if out is None else [out], use_triton)[0]


# ---------------------------------------------------------------------------------------------
# pull_pages (a whole view read straight from every owner's pool)
# ---------------------------------------------------------------------------------------------


def pull_pages_ref(
    sources: Sequence[torch.Tensor], slot_phys: torch.Tensor, slots_per_rank: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[x] = sources[x // S][slot_phys[x]]``: every owner's block of the view from that owner's pages
    (``sources[o]`` page-major ``[P, W]``, owner ``o``'s buffer; ``S`` = ``slots_per_rank``)."""
    s = slots_per_rank
    parts = [src.index_select(0, slot_phys[o * s : (o + 1) * s].long()) for o, src in enumerate(sources)]
    view = torch.cat(parts)
    return view if out is None else out.copy_(view)


if triton is not None:

    @triton.jit(do_not_specialize=["start", "layer"])
    def _pull_pages_kernel(
        slot_phys,
        start,
        num_slots,
        slots_per_rank,
        table,
        layer,
        cp_size,
        out_a,
        words_a,
        stride_a,
        out_b,
        words_b,
        stride_b,
        BLOCK: tl.constexpr,
    ):
        # slot_phys: int64, the view's send entries from word ``start`` on (a plan's output buffer).
        # table: int64 [layers, 2, cp_size], the address of owner o's buffer k (0 latent, 1 indexer) of a
        # layer, int32 words apart by stride_k per page. Program (i, k) copies slots i, i + G, ... of buffer
        # k (grid column k), each from the pool of the owner whose block holds it.
        first = tl.program_id(0).to(tl.int64)
        k = tl.program_id(1)
        owners = table + (layer.to(tl.int64) * 2 + k) * cp_size
        for slot in range(first, num_slots, tl.num_programs(0)):
            page = tl.load(slot_phys + start + slot).to(tl.int64)
            src = tl.load(owners + slot // slots_per_rank).to(tl.pointer_type(tl.int32))
            if k == 0:
                _copy_page(src + page * stride_a, out_a + slot * words_a, words_a, BLOCK)
            else:
                _copy_page(src + page * stride_b, out_b + slot * words_b, words_b, BLOCK)


# The arguments of a pull launch that change between batches and layers (``set_free_int``/``set_args``).
PULL_START_ARG, PULL_LAYER_ARG = 1, 5


def pull_launch(
    table: torch.Tensor,
    slot_phys: torch.Tensor,
    slots_per_rank: int,
    outs: Sequence[torch.Tensor],
    source_strides: Sequence[int],
    layer: int = 0,
    start: int = 0,
    slots: int | None = None,
) -> PreparedLaunch:
    """The launch that fills whole views ``outs`` (one or two, int32 words ``[N * S, W]``, contiguous) of
    ``layer`` from every owner's pool pages, through ``table`` (int64 ``[layers, 2, N]``, the owners' buffer
    addresses, ``copy_engine.CopyEngineGroup.source_table``); ``source_strides[k]``: words from one page of
    buffer ``k`` to the next. The view's send entries are ``slots`` (default: all past ``start``) words of
    ``slot_phys`` from ``start`` on: a plan's output buffer and its ``send_start``, so the next batch
    changes an int, not a tensor. ``set_free_int(PULL_LAYER_ARG, layer)`` serves another layer into the
    same views, ``set_free_int(PULL_START_ARG, start)`` another batch's entries in the same buffer."""
    args = [(o, o.shape[1], stride) for o, stride in zip(outs, source_strides)]
    a, b = args[0], args[-1]
    slots = slot_phys.shape[0] - start if slots is None else slots
    if start < 0 or slots < 0 or start + slots > slot_phys.shape[0]:
        raise ValueError(f"send entries [{start}, {start + slots}) past slot_phys's {slot_phys.shape[0]} words")
    block = min(4096, triton.next_power_of_2(max(w for _, w, _ in args)))
    return PreparedLaunch(
        _pull_pages_kernel,
        (slots, len(args)),
        (slot_phys, start, slots, slots_per_rank, table, layer, table.shape[2], *a, *b),
        {"BLOCK": block},
        num_warps=8 if block >= 2048 else 4,
    )


# ---------------------------------------------------------------------------------------------
# positions_to_view_rows (token-level remap of NSA top-k positions)
# ---------------------------------------------------------------------------------------------


def positions_to_view_rows_ref(
    positions: torch.Tensor, q_req: torch.Tensor, page_table: torch.Tensor, page_size: int
) -> torch.Tensor:
    """``row = page_table[q_req, pos // ps] * ps + pos % ps`` (same dtype as ``positions``); -1 stays -1."""
    pos = positions.long()
    valid = pos >= 0
    safe = torch.where(valid, pos, torch.zeros_like(pos))
    req = q_req.long().view(-1, *([1] * (pos.dim() - 1))).expand_as(pos)
    pages = page_table.long()[req, safe // page_size]
    rows = pages * page_size + safe % page_size
    return torch.where(valid, rows, torch.full_like(rows, -1)).to(positions.dtype)


if triton is not None:

    @triton.jit
    def _positions_to_rows_kernel(positions, q_req, page_table, out, k, pt_stride, page_size, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        block = tl.program_id(1)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        inside = offs < k
        pos = tl.load(positions + t.to(tl.int64) * k + offs, mask=inside, other=-1).to(tl.int64)
        valid = pos >= 0
        safe = tl.where(valid, pos, 0)
        req = tl.load(q_req + t).to(tl.int64)
        page = tl.load(page_table + req * pt_stride + safe // page_size, mask=inside & valid, other=0).to(tl.int64)
        rows = tl.where(valid, page * page_size + safe % page_size, -1)
        tl.store(out + t.to(tl.int64) * k + offs, rows.to(out.dtype.element_ty), mask=inside)


def positions_to_view_rows(
    positions: torch.Tensor,
    q_req: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Map ``positions [T, K]`` (token positions in request ``q_req[t]``, -1 padded) to view rows."""
    check_index("positions", positions, 2)
    check_index("q_req", q_req, 1)
    check_index("page_table", page_table, 2)
    if q_req.shape[0] != positions.shape[0]:
        raise ValueError(f"q_req must have one entry per query ({positions.shape[0]}), got {q_req.shape[0]}")
    check_int("page_size", page_size, 1)
    if not triton_enabled(positions.device, use_triton) or positions.numel() == 0:
        return positions_to_view_rows_ref(positions, q_req, page_table, page_size)
    positions = positions.contiguous()
    table = page_table if page_table.stride(1) == 1 else page_table.contiguous()
    out = torch.empty_like(positions)
    t, k = positions.shape
    block = min(1024, triton.next_power_of_2(k))
    grid = (t, triton.cdiv(k, block))
    args = (positions, q_req, table, out, k, table.stride(0), page_size)
    launch(_positions_to_rows_kernel, grid, args, {"BLOCK": block})
    return out


# ---------------------------------------------------------------------------------------------
# translate_locs (logical locs -> read-buffer rows, through a batch's page map)
# ---------------------------------------------------------------------------------------------


def translate_locs_ref(
    page_pos: torch.Tensor, locs: torch.Tensor, page_size: int, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``page_pos[loc // ps] * ps + loc % ps`` for every loc (any shape; ``out_dtype``, default the locs')."""
    loc = locs.long()
    rows = page_pos[loc // page_size] * page_size + loc % page_size
    return rows.to(out_dtype or locs.dtype)


if triton is not None:

    @triton.jit
    def _translated_rows(page_pos, loc, live, page_size, num_pages):
        """The read-buffer rows of int64 token locs ``loc`` (``translate_locs_ref``; 0 where not ``live``)."""
        # Floor division and a non-negative remainder, and negative pages from the end, as torch indexes.
        offset = loc % page_size
        offset = tl.where(offset < 0, offset + page_size, offset)
        page = (loc - offset) // page_size
        page = tl.where(page < 0, page + num_pages, page)
        return tl.load(page_pos + page, mask=live, other=0) * page_size + offset

    @triton.jit(do_not_specialize=["n", "page_size", "num_pages"])
    def _translate_kernel(page_pos, locs, out, n, page_size, num_pages, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        loc = tl.load(locs + i, mask=live, other=0).to(tl.int64)
        row = _translated_rows(page_pos, loc, live, page_size, num_pages)
        tl.store(out + i, row.to(out.dtype.element_ty), mask=live)


_TRANSLATE_BLOCK = 1024


def translate_locs(
    page_pos: torch.Tensor,
    locs: torch.Tensor,
    page_size: int,
    out_dtype: torch.dtype | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """``translate_locs_ref`` in one launch (page ids with ``page_size`` 1)."""
    return _translate(page_pos, locs, page_size, out_dtype, use_triton)[0]


def _translate(
    page_pos: torch.Tensor,
    locs: torch.Tensor,
    page_size: int,
    out_dtype: torch.dtype | None,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, PreparedLaunch | None]:
    """``translate_locs`` and the launch that made it (None: the reference did)."""
    if locs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"locs must be int32 or int64, got {locs.dtype}")
    if locs.device != page_pos.device:  # a launch hands the kernel addresses: both on one device
        raise ValueError(f"locs are on {locs.device}, the page map on {page_pos.device}: translate on one device")
    if not triton_enabled(page_pos.device, use_triton) or locs.numel() == 0:
        return translate_locs_ref(page_pos, locs, page_size, out_dtype), None
    # The kernel walks the locs as flat memory: a contiguous tensor of any shape as is (SGLang's page
    # tables are), anything else through one contiguous copy.
    flat = locs if locs.is_contiguous() else locs.contiguous()
    out = torch.empty_like(flat, dtype=out_dtype)  # the locs' shape, contiguous (``None``: their dtype)
    n = flat.numel()
    prepared = launch(
        _translate_kernel,
        (-(-n // _TRANSLATE_BLOCK),),  # host time: plain ints, no Triton helper
        (page_pos, flat, out, n, page_size, page_pos.shape[0]),
        {"BLOCK": _TRANSLATE_BLOCK},
    )
    return out, prepared


class LocTranslator:
    """``translate_locs`` over one page map that its owner rewrites in place batch after batch (``page_pos``,
    int64 ``[pages]``), for SGLang's per-batch page-table translation.

    The first translation of each (locs dtype, out dtype) goes through ``launch``, which compiles or finds
    the kernel; later ones whose locs are contiguous, 16-byte aligned and fewer than 2**31 (what that kernel
    was specialized on: the out buffer is a fresh allocation, aligned) hand its launcher the three addresses
    and the lengths, nothing else looked up or keyed (host time: a translation's own launch is what it
    costs). Anything else, and every launch under the interpreter or with Triton's launch hooks set, goes
    through ``translate_locs``.
    """

    def __init__(self, page_pos: torch.Tensor, page_size: int):
        self.page_pos, self.page_size = page_pos, page_size
        self._address, self._pages, self._device = page_pos.data_ptr(), page_pos.shape[0], page_pos.device
        self._device_index = page_pos.get_device()  # -1 on CPU: compared as an int (host time: no device object)
        self._kernels: dict[tuple, object] = {}  # (locs dtype, out dtype) -> that pair's compiled kernel

    def __call__(self, locs: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``translate_locs(page_pos, locs, page_size, out_dtype)``."""
        dtype = out_dtype or locs.dtype
        kernel = self._kernels.get((locs.dtype, dtype))
        n = locs.numel()
        if kernel is not None and _no_launch_hooks() and locs.get_device() == self._device_index:  # addresses unchecked
            address = _direct_address(locs, n)
            if address is not None:
                out = torch.empty_like(locs, dtype=dtype)  # contiguous, as the locs are
                stream = current_stream_handle(self._device)
                kernel.run(
                    -(-n // _TRANSLATE_BLOCK), 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                    self._address, address, out.data_ptr(), n, self.page_size, self._pages, _TRANSLATE_BLOCK,
                )  # fmt: skip
                return out
        out, prepared = _translate(self.page_pos, locs, self.page_size, out_dtype)
        # The kernel this launch ran, kept where it was specialized as the direct path's launches are (the
        # site's launch object itself is relaunched by every other translation).
        kernel = None if prepared is None else prepared.compiled()
        if kernel is not None and prepared.args[1] is locs and _direct_address(locs, n) is not None:
            self._kernels[(locs.dtype, dtype)] = kernel
        return out


def _direct_address(locs: torch.Tensor, n: int) -> int | None:
    """The address of ``locs`` (``n`` elements) where a translation's compiled kernel takes them as its
    specialization did (contiguous, 16-byte aligned, fewer than 2**31), else None."""
    if 0 < n < (1 << 31) and locs.is_contiguous():
        address = locs.data_ptr()
        if address % 16 == 0:
            return address
    return None


# ---------------------------------------------------------------------------------------------
# A translation whose table is named on the device (queued in one graph with the batch's plan)
# ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit(do_not_specialize=["page_size", "num_pages"])
    def _translate_planned_kernel(page_pos, words, page_size, num_pages, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        # ``words`` (int64, device): the locs' address, their count (0: nothing to do), row length and row
        # stride, then the address of the contiguous rows out; locs and rows int32. A fixed grid walks any
        # count, so the launch's arguments never change and it can sit in a captured graph. (No parameter
        # may be named ``params``: Triton's argument binder takes that name for its own dict.)
        n = tl.load(words + 1)
        locs = tl.load(words).to(tl.pointer_type(tl.int32))
        cols = tl.load(words + 2)
        stride = tl.load(words + 3)
        out = tl.load(words + 4).to(tl.pointer_type(tl.int32))
        lanes = tl.arange(0, BLOCK)
        for i0 in range(tl.program_id(0).to(tl.int64) * BLOCK, n, PROGRAMS * BLOCK):
            i = i0 + lanes
            live = i < n
            r = i // cols
            loc = tl.load(locs + r * stride + (i - r * cols), mask=live, other=0).to(tl.int64)
            row = _translated_rows(page_pos, loc, live, page_size, num_pages)
            tl.store(out + i, row.to(tl.int32), mask=live)


_PLANNED_PROGRAMS = 128  # one wave on an H200 (132 SMs); a 32K-token table is one pass of them


def planned_translation(page_pos: torch.Tensor, params: torch.Tensor, page_size: int) -> PreparedLaunch:
    """A bound, unqueued launch of ``translate_locs_ref(page_pos, locs, page_size)`` for int32 locs named by
    ``params`` (int64 ``[>= 5]`` on ``page_pos``'s device: the locs' address, count, row length, row stride
    and the out address), which earlier work on the stream writes: its arguments are the same batch after
    batch, so it is captured into a graph with the plan that writes them (``LaunchSequence``). The launch is
    the caller's own object, not a shared site's (a site's is rebound by its other callers)."""
    if params.dtype != torch.int64 or params.numel() < 5 or params.device != page_pos.device:
        raise ValueError(f"params must be int64 [>= 5] on {page_pos.device}, got {params.dtype} on {params.device}")
    args = (page_pos, params, page_size, page_pos.shape[0])
    return PreparedLaunch(
        _translate_planned_kernel, (_PLANNED_PROGRAMS,), args, {"BLOCK": 1024, "PROGRAMS": _PLANNED_PROGRAMS}
    )


class LaunchSequence:
    """Bound launches queued one after another, taken as one by ``CopyEngineGroup.fence(then=)``: in one
    captured graph once every one is compiled."""

    def __init__(self, *launches: PreparedLaunch):
        self.launches = launches
        self._graph_key: GraphKey | None = None

    def __call__(self) -> None:
        for one in self.launches:
            one()

    def compiled(self) -> LaunchSequence | None:
        """This sequence where every launch has a compiled kernel (``PreparedLaunch.compiled``), else None."""
        return self if all(one.compiled() is not None for one in self.launches) else None

    def launch_on(self, stream: int) -> None:
        for one in self.launches:
            one.launch_on(stream)

    def graph_key(self) -> GraphKey:
        """The launches' ``graph_key`` s as one key, the same object while each launch's is (host time: one hash
        per batch, not one per launch)."""
        keys = tuple(one.graph_key() for one in self.launches)
        key = self._graph_key
        if key is None or any(a is not b for a, b in zip(keys, key.args)):
            key = self._graph_key = GraphKey(keys, keys)
        return key
