"""Static check: the plan, remap and materialize modules contain no host-syncing or dynamic-shape call.

Device data read back to the host (``.item()``, ``.tolist()``, ``.cpu()``, ...) stalls the CPU until
the GPU catches up; data-dependent shapes (``nonzero``, ``unique``, ``bincount``, boolean-mask
indexing) do the same and break CUDA graphs. The syncing diagnostics live in ``debug_checks`` and
may run only behind ``debug_enabled()``.
"""

import ast
from pathlib import Path

import pytest

import sglang_cp_shared_kv.srt.distributed as distributed
import sglang_cp_shared_kv.srt.layers.attention.nsa as nsa

NSA_DIR = Path(nsa.__file__).parent
# The plan, the kernels, the materializer and the CP group whose collectives it calls per layer.
CHECKED = [
    NSA_DIR / name for name in ("slot_plan.py", "materialize_kernels.py", "materialize.py", "current_reuse.py")
] + [Path(distributed.__file__).parent / "cp_group.py"]

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


def _is_cpu(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value == "cpu":
        return True
    return isinstance(node, ast.Call) and any(_is_cpu(a) for a in node.args)


def host_sync_findings(source: str) -> list[str]:
    """Every forbidden construct in ``source``, as ``line: what``."""
    tree = ast.parse(source)
    debug_names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith(DEBUG_MODULE)
        for alias in node.names
    }
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "debug_enabled" in ast.unparse(node.test):
            guarded.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if isinstance(func, ast.Attribute) and name in FORBIDDEN_METHODS:
                found.append(f"{node.lineno}: .{name}()")
            if name == "where" and len(node.args) == 1 and not node.keywords:
                found.append(f"{node.lineno}: one-argument where (a nonzero)")
            if name == "to" and (any(_is_cpu(a) for a in node.args) or any(_is_cpu(k.value) for k in node.keywords)):
                found.append(f"{node.lineno}: .to(cpu)")
            if name in debug_names and id(node) not in guarded:
                found.append(f"{node.lineno}: {name}() outside an `if debug_enabled():` block")
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
                    found.append(f"{node.lineno}: boolean-mask indexing")
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
    )
    assert host_sync_findings(ok) == []
