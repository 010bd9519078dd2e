"""Static check: every module the wired read/write path runs per batch or per layer contains no
host-syncing or dynamic-shape construct.

Device data read back to the host (``.item()``, ``.tolist()``, ``.cpu()``, ``int(t.sum())``,
``bool(t)``, ``if t:``, ``torch.equal``, a slice bounded by a tensor value) stalls the CPU until
the GPU catches up; data-dependent shapes (``nonzero``, ``unique``, ``bincount``, boolean-mask
indexing, ``repeat_interleave`` without ``output_size``) do the same and break CUDA graphs; a
host list copied with ``torch.tensor(list).to(device)`` comes from pageable memory, which the
copy waits for. The syncing diagnostics run only under ``if debug_enabled():`` (directly, or in
a function that is only ever called there); a host read of data already on the host carries a
``# sync-ok: <why>`` comment on its line.
"""

import ast
from pathlib import Path

import pytest

import sglang_cp_shared_kv.srt.distributed as distributed
import sglang_cp_shared_kv.srt.layers.attention.nsa as nsa
import sglang_cp_shared_kv.srt.mem_cache as mem_cache
import sglang_cp_shared_kv.srt.sglang_wiring as sglang_wiring

NSA_DIR = Path(nsa.__file__).parent
# Per batch or per layer on the wired path: the plan, the kernels, the materializer, the CP group
# whose collectives it calls, the SGLang pools' write path and their read state, the metrics
# recorded around each batch, and the ownership arithmetic of every store.
CHECKED = (
    [
        NSA_DIR / n
        for n in (
            "slot_plan.py",
            "plan_kernels.py",
            "triton_launch.py",
            "materialize_kernels.py",
            "materialize.py",
            "read_state.py",
        )
    ]
    + [NSA_DIR / "page_source.py"]
    + [Path(distributed.__file__).parent / n for n in ("cp_group.py", "copy_engine.py")]
    + [Path(sglang_wiring.__file__).parent / n for n in ("sharded_kv_pool.py", "metrics.py")]
    + [Path(mem_cache.__file__).parent / "placement.py"]
)

FORBIDDEN_METHODS = {
    "item",
    "tolist",
    "cpu",
    "numpy",
    "nonzero",
    "argwhere",
    "unique",
    "unique_consecutive",
    "bincount",
    "masked_select",
    "any",
    "all",
    "is_nonzero",
    "synchronize",
}
MASK_METHODS = {"eq", "ne", "gt", "ge", "lt", "le", "logical_and", "logical_or", "logical_not", "isin"}
DEBUG_MODULE = "debug_checks"
PRAGMA = "# sync-ok:"
# Methods and attributes of a tensor whose result lives on the host.
HOST_RESULTS = {
    "shape",
    "dtype",
    "device",
    "get_device",
    "ndim",
    "is_cuda",
    "size",
    "dim",
    "numel",
    "stride",
    "element_size",
    "nbytes",
    "itemsize",
    "data_ptr",
    "is_contiguous",
    "storage_offset",
    "_version",  # the in-place modification counter, kept on the host
    "type",
    "tolist",
    "item",
    "query",
}
# torch functions whose result is not a device tensor.
TORCH_HOST = {"device", "dtype", "Size", "is_tensor", "get_default_dtype", "Generator", "equal", "cuda", "Event"}
PAGEABLE_SOURCES = {"tensor", "as_tensor", "from_numpy"}


def _is_cpu(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value == "cpu":
        return True
    return isinstance(node, ast.Call) and any(_is_cpu(a) for a in node.args)


def _is_torch_call(node: ast.AST, names: set[str]) -> bool:
    """``torch.<name>(...)`` for a name in ``names``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
        and node.func.attr in names
    )


TENSOR_ANNOTATIONS = {"torch.Tensor", "Tensor", "torch.Tensor | None", "Optional[torch.Tensor]"}


def _annotated_tensor(annotation: ast.AST | None) -> bool:
    return annotation is not None and ast.unparse(annotation) in TENSOR_ANNOTATIONS


class _Tensors:
    """Which expressions of one function are device tensors (a conservative, name-based inference)."""

    def __init__(self, fn: ast.AST | None, tensor_attrs: set[str]):
        self.names: set[str] = set()
        self.attrs = tensor_attrs
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            args = fn.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if _annotated_tensor(a.annotation):
                    self.names.add(a.arg)
        body = list(ast.walk(fn)) if fn is not None else []
        changed = True
        while changed:  # names assigned from tensor expressions, to a fixpoint
            changed = False
            for node in body:
                targets, value = _assignment(node)
                if value is None or not self.is_tensor(value):
                    continue
                for t in targets:
                    for name in _target_names(t):
                        if name not in self.names:
                            self.names.add(name)
                            changed = True

    def is_tensor(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.names
        if isinstance(node, ast.Attribute):
            if node.attr in HOST_RESULTS:
                return False
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return node.attr in self.attrs
            return self.is_tensor(node.value)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                if isinstance(func.value, ast.Name) and func.value.id == "torch":
                    return func.attr not in TORCH_HOST
                if func.attr in HOST_RESULTS:
                    return False
                return self.is_tensor(func.value)
            return False
        if isinstance(node, ast.Subscript):
            return self.is_tensor(node.value)
        if isinstance(node, ast.BinOp):
            return self.is_tensor(node.left) or self.is_tensor(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.is_tensor(node.operand)
        if isinstance(node, ast.Compare):  # identity and membership tests are host values
            if any(isinstance(op, ast.Is | ast.IsNot | ast.In | ast.NotIn) for op in node.ops):
                return False
            return self.is_tensor(node.left) or any(self.is_tensor(c) for c in node.comparators)
        return False


def _assignment(node: ast.AST) -> tuple[list[ast.AST], ast.AST | None]:
    if isinstance(node, ast.Assign):
        return node.targets, node.value
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target], node.value
    return [], None


def _target_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List):
        return [n for t in target.elts for n in _target_names(t)]
    return []


def _tensor_attrs(tree: ast.AST) -> set[str]:
    """``self.<attr>`` names ever assigned a tensor (or annotated as one) in the module."""
    attrs: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        tensors = _Tensors(fn, attrs)
        for node in ast.walk(fn):
            targets, value = _assignment(node)
            annotated = isinstance(node, ast.AnnAssign) and _annotated_tensor(node.annotation)
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    if annotated or (value is not None and tensors.is_tensor(value)):
                        attrs.add(t.attr)
    return attrs


def _guarded_nodes(tree: ast.AST) -> set[int]:
    """Nodes under ``if debug_enabled():``, and the bodies of functions only ever called there."""
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "debug_enabled" in ast.unparse(node.test):
            guarded.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        # `if not debug_enabled() ...: return` guards the rest of the block.
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, stmt in enumerate(block):
                if (
                    isinstance(stmt, ast.If)
                    and "not debug_enabled()" in ast.unparse(stmt.test)
                    and stmt.body
                    and isinstance(stmt.body[-1], ast.Return)
                ):
                    guarded.update(id(n) for rest in block[i + 1 :] for n in ast.walk(rest))
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    calls: dict[str, list[ast.Call]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            calls.setdefault(name, []).append(node)
    changed = True
    while changed:
        changed = False
        for fn in functions:
            sites = calls.get(fn.name, [])
            if id(fn) not in guarded and sites and all(id(c) in guarded for c in sites):
                guarded.update(id(n) for n in ast.walk(fn))
                changed = True
    return guarded


def host_sync_findings(source: str) -> list[str]:
    """Every forbidden construct in ``source``, as ``line: what``."""
    tree = ast.parse(source)
    lines = source.splitlines()
    debug_names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith(DEBUG_MODULE)
        for alias in node.names
    }
    guarded = _guarded_nodes(tree)
    attrs = _tensor_attrs(tree)
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    tensors_of: dict[int, _Tensors] = {}
    for fn in scopes:  # innermost function wins (walk order: outer before inner)
        t = _Tensors(fn, attrs)
        tensors_of.update((id(n), t) for n in ast.walk(fn))
    module_tensors = _Tensors(tree, attrs)  # module-level code
    found = []

    def flag(node: ast.AST, what: str) -> None:
        if id(node) in guarded:
            return
        line = lines[node.lineno - 1] if 0 < node.lineno <= len(lines) else ""
        if PRAGMA in line and line.split(PRAGMA, 1)[1].strip():
            return
        found.append(f"{node.lineno}: {what}")

    for node in ast.walk(tree):
        tensors = tensors_of.get(id(node), module_tensors)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if isinstance(func, ast.Attribute) and name in FORBIDDEN_METHODS:
                flag(node, f".{name}()")
            if name == "where" and len(node.args) == 1 and not node.keywords:
                flag(node, "one-argument where (a nonzero)")
            if name == "to" and (any(_is_cpu(a) for a in node.args) or any(_is_cpu(k.value) for k in node.keywords)):
                flag(node, ".to(cpu)")
            if name in debug_names:
                flag(node, f"{name}() outside an `if debug_enabled():` block")
            if isinstance(func, ast.Name) and name in ("int", "float", "bool") and node.args:
                if tensors.is_tensor(node.args[0]):
                    flag(node, f"{name}() of a tensor")
            if name == "equal" and isinstance(func, ast.Attribute):
                flag(node, "torch.equal (reads the result back)")
            if name == "repeat_interleave" and not any(k.arg == "output_size" for k in node.keywords):
                flag(node, "repeat_interleave without output_size")
            if name == "to" and isinstance(func, ast.Attribute) and _is_torch_call(func.value, PAGEABLE_SOURCES):
                flag(node, "torch.tensor(host data).to(device): a copy from pageable memory")
            if _is_torch_call(node, {"tensor", "as_tensor"}):
                device = [k.value for k in node.keywords if k.arg == "device"]
                if device and not _is_cpu(device[0]):
                    flag(node, "torch.tensor(host data, device=...): a copy from pageable memory")
        if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert) and tensors.is_tensor(node.test):
            flag(node, "a tensor as a condition")
        if isinstance(node, ast.BoolOp) and any(tensors.is_tensor(v) for v in node.values):
            flag(node, "a tensor in and/or")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and tensors.is_tensor(node.operand):
            flag(node, "`not` of a tensor")
        if isinstance(node, ast.Subscript):
            index = node.slice
            parts = index.elts if isinstance(index, ast.Tuple) else [index]
            for part in parts:
                is_mask = isinstance(part, ast.Compare | ast.BoolOp) or (
                    isinstance(part, ast.UnaryOp) and isinstance(part.op, ast.Invert)
                )
                is_mask |= (
                    isinstance(part, ast.Call)
                    and isinstance(part.func, ast.Attribute)
                    and part.func.attr in MASK_METHODS
                )
                if is_mask:
                    flag(node, "boolean-mask indexing")
                if isinstance(part, ast.Slice) and any(
                    b is not None and tensors.is_tensor(b) for b in (part.lower, part.upper, part.step)
                ):
                    flag(node, "a slice bounded by a tensor value")
    return found


@pytest.mark.parametrize("module", CHECKED, ids=lambda p: p.name)
def test_module_has_no_host_sync(module):
    findings = host_sync_findings(module.read_text())
    assert findings == [], f"{module.name} syncs with the host: {findings}"


@pytest.mark.parametrize(
    "snippet",
    [
        "n = int(x.sum().item())",
        "v = x.tolist()",
        "h = x.cpu()",
        "h = x.to('cpu')",
        "h = x.to(device=torch.device('cpu'))",
        "i = torch.nonzero(x)",
        "i = x.nonzero()",
        "i = torch.where(x > 0)",
        "u = torch.unique(x)",
        "c = torch.bincount(x)",
        "y = x[x > 0]",
        "y = x[:, x.ne(0)]",
        "y = x[~m]",
        "ok = (x > 0).any()",
        "torch.cuda.synchronize()",
        "from pkg.debug_checks import check_plan\ncheck_plan(p, g)",
        # Tensors read back through Python's conversions and conditions.
        "def f(x: torch.Tensor):\n    n = int(x.sum())",
        "def f(x: torch.Tensor):\n    v = float(x)",
        "def f(x: torch.Tensor):\n    ok = bool(x)",
        "def f(x: torch.Tensor):\n    if x:\n        pass",
        "def f(x: torch.Tensor):\n    while x > 0:\n        pass",
        "def f(x: torch.Tensor):\n    y = 1 if x.max() > 3 else 0",
        "def f(x: torch.Tensor):\n    ok = not x",
        "def f(x: torch.Tensor, y):\n    ok = x.min() < 0 or y",
        "t = torch.zeros(3)\nif t.sum():\n    pass",
        "t = torch.arange(4)\nn = int(t[0])",
        "class C:\n    def a(self):\n        self.t = torch.zeros(2)\n    def b(self):\n        return bool(self.t)",
        "same = torch.equal(a, b)",
        "y = torch.repeat_interleave(a, c)",
        "y = a.repeat_interleave(c, dim=0)",
        "def f(x: torch.Tensor, n: torch.Tensor):\n    y = x[: n]",
        "def f(x: torch.Tensor, n: torch.Tensor):\n    y = x[n.sum() :]",
        "p = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)",
        "p = torch.as_tensor(arr).to(device)",
        "p = torch.tensor(flat, device=device)",
        # Not guarded: the pragma needs a reason; a function also called outside debug mode.
        "def f(x: torch.Tensor):\n    v = x.tolist()  # sync-ok:",
        "def _check(x):\n    return x.any()\nif debug_enabled():\n    _check(a)\n_check(b)",
    ],
)
def test_checker_flags_each_forbidden_construct(snippet):
    assert host_sync_findings(snippet), snippet


def test_checker_accepts_guarded_debug_calls_and_static_ops():
    ok = (
        "from pkg.debug_checks import check_plan\n"
        "if debug_enabled():\n    check_plan(p, g)\n"
        "y = torch.where(m, a, b)\n"
        "z = x.index_select(0, i)\n"
        "w = t.to(device, non_blocking=True)\n"
        "y = torch.repeat_interleave(a, c, output_size=n)\n"
        "def f(x: torch.Tensor, n: int, o: torch.Tensor | None):\n"
        "    m = int(x.shape[0]) + int(n) + x.numel() + x.size(0)\n"
        "    if o is None or x.dtype != torch.int64 or x.shape != (2,):\n"
        "        return x[:n]\n"
        "    host = x.tolist()  # sync-ok: x is a host tensor here\n"
        "    return bool(host[0])\n"
        "def _check(x):\n    return bool(x.any())\n"
        "if debug_enabled():\n    _check(a)\n"
        "def g(x: torch.Tensor):\n"
        "    if not debug_enabled():\n        return\n"
        "    if bool((x < 0).any()):\n        raise ValueError('negative')\n"
        "p = copy_to_device(torch.tensor(flat), device)\n"
    )
    assert host_sync_findings(ok) == []
