"""Python source in SGLang's layout: its formatter at 88 columns, and prose and long string literals
wrapped to fit, for the upstream series (``make_upstream_patch.py``).

``ruff format`` lays out code but leaves comments, docstrings and string literals as they are. Here a
long string literal is split into adjacent literals at spaces (parenthesized where it stands alone), a
comment block or a docstring paragraph is refilled, and an inline comment that does not fit moves to
the line above its code. ``layout`` refuses a result whose syntax tree differs from the input's other
than in docstring whitespace: the code is the same code.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import textwrap
import tokenize

WIDTH = 88
# Inline comments that tools read where they stand.
_PRAGMA = re.compile(r"#\s*(noqa|type:|fmt:|pragma|isort:)")
_LIST_ITEM = re.compile(r"^(\s*)([-*]|\d+\.)\s+")


class LayoutError(ValueError):
    """The laid-out text is not the same program as the input."""


def ruff_format(text: str, width: int = WIDTH) -> str:
    """``text`` through ``ruff format`` at ``width`` columns, with no project configuration."""
    cmd = [sys.executable, "-m", "ruff", "format", "--isolated", f"--line-length={width}", "-"]
    proc = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise LayoutError(f"ruff format failed: {proc.stderr.strip()[:300]}")
    return proc.stdout


def _split_literal(token: str, first: int, rest: int, tail: int = 0) -> list[str] | None:
    """A one-line string literal as adjacent literals, the first at most ``first`` columns wide, the
    others ``rest`` and the last ``tail`` less, split after spaces (never inside an f-string's
    braces); None if it cannot be."""
    m = re.match(r"^([rRbBfFuU]*)(['\"])(.*)\2$", token, re.DOTALL)
    if m is None or token.endswith(m[2] * 3):
        return None
    prefix, quote, body = m[1], m[2], m[3]
    is_f = "f" in prefix.lower()
    cuts, depth, i = [], 0, 0  # positions after a space, outside braces
    while i < len(body):
        c = body[i]
        if c == "\\":
            i += 2
            continue
        if is_f and body.startswith(("{{", "}}"), i):
            i += 2
            continue
        depth += (c == "{") - (c == "}") if is_f else 0
        if c == " " and depth == 0:
            cuts.append(i + 1)
        i += 1
    pieces, start = [], 0
    while True:
        width = rest if pieces else first
        if len(body) - start + len(prefix) + 2 + tail <= width:
            break
        fit = [c for c in cuts if start < c and c - start + len(prefix) + 2 <= width]
        if not fit:
            return None
        pieces.append(body[start : fit[-1]])
        start = fit[-1]
    pieces.append(body[start:])
    if len(pieces) == 1:
        return None

    def literal(part: str) -> str:
        p = prefix
        if is_f and "{" not in part and "}" not in part:
            p = re.sub("[fF]", "", p)
        return f"{p}{quote}{part}{quote}"

    return [literal(p) for p in pieces]


def split_strings(text: str) -> str:
    """Split each one-line string literal that runs past ``WIDTH`` into adjacent literals, in the
    brackets it stands in or in parentheses of its own."""
    lines = text.splitlines(keepends=True)
    edits = []  # (row, col_start, col_end, replacement lines, needs parentheses)
    depth = 0
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    for tok in tokens:
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        if tok.type != tokenize.STRING or tok.start[0] != tok.end[0]:
            continue
        row, col = tok.start
        line = lines[row - 1]
        if len(line.rstrip("\n")) <= WIDTH:
            continue
        indent = col if depth else len(line) - len(line.lstrip()) + 4
        tail = len(line.rstrip("\n")) - tok.end[1]
        pieces = _split_literal(tok.string, WIDTH - indent, WIDTH - indent, tail if depth else 0)
        if pieces is None:
            continue
        edits.append((row, col, tok.end[1], pieces, indent, not depth))
    for row, start, end, pieces, indent, wrap in reversed(edits):
        line = lines[row - 1]
        pad = " " * indent
        if wrap:
            outer = " " * (indent - 4)
            body = "".join(f"{pad}{p}\n" for p in pieces)
            new = f"{line[:start]}(\n{body}{outer}){line[end:]}"
        else:
            new = line[:start] + f"\n{pad}".join(pieces) + line[end:]
        lines[row - 1] = new
    return "".join(lines)


def _fill(words: str, indent: str, width: int, hang: str = "") -> list[str]:
    return textwrap.wrap(
        words,
        width=width,
        initial_indent=indent,
        subsequent_indent=indent + hang,
        break_long_words=False,
        break_on_hyphens=False,
    )


def wrap_comments(text: str) -> str:
    """Refill each block of full-line comments that has a line past ``WIDTH``; move an inline comment
    that does not fit to the line above its code (pragmas stay)."""
    comments = {
        t.start[0]: t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT
    }
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        tok = comments.get(i + 1)
        stripped = line.strip()
        if tok is not None and stripped.startswith("#") and not _PRAGMA.search(stripped):
            indent = line[: len(line) - len(line.lstrip())]
            block = [line]
            while i + len(block) < len(lines):
                nxt = lines[i + len(block)]
                if not nxt.strip().startswith("#") or (i + len(block) + 1) not in comments:
                    break
                if nxt[: len(nxt) - len(nxt.lstrip())] != indent or _PRAGMA.search(nxt):
                    break
                block.append(nxt)
            if any(len(b.rstrip("\n")) > WIDTH for b in block):
                out.extend(c + "\n" for c in _refill_comment(block, indent))
            else:
                out.extend(block)
            i += len(block)
            continue
        if tok is not None and len(line.rstrip("\n")) > WIDTH and not _PRAGMA.search(tok.string):
            code = line[: tok.start[1]].rstrip()
            indent = line[: len(line) - len(line.lstrip())]
            words = tok.string.lstrip("#").strip()
            out.extend(c + "\n" for c in _fill(words, indent + "# ", WIDTH))
            out.append(code + "\n")
            i += 1
            continue
        out.append(line)
        i += 1
    return "".join(out)


def _refill_comment(block: list[str], indent: str) -> list[str]:
    """A block of ``# ...`` lines refilled; list items and blank ``#`` lines keep their breaks."""
    out: list[str] = []
    para: list[str] = []
    hang = ""

    def flush() -> None:
        nonlocal para, hang
        if para:
            out.extend(_fill(" ".join(para), indent + "# ", WIDTH, hang))
        para, hang = [], ""

    for line in block:
        body = line.strip()[1:]
        body = body[1:] if body.startswith(" ") else body
        if not body.strip():
            flush()
            out.append(indent + "#")
            continue
        item = _LIST_ITEM.match(body)
        if item or body.startswith("    "):
            flush()
            if not item:
                out.append(indent + "# " + body)
                continue
            hang = " " * len(item[0])
        para.append(body.strip())
    flush()
    return out


def wrap_docstrings(text: str) -> str:
    """Refill each docstring paragraph that has a line past ``WIDTH``: plain paragraphs and list
    items; code blocks (indented, or after ``::``), tables and doctest lines stay as written."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                spans.append((first.lineno, first.end_lineno))
    for start, end in sorted(spans, reverse=True):
        block = lines[start - 1 : end]
        if all(len(b.rstrip("\n")) <= WIDTH for b in block):
            continue
        new = _refill_docstring(block)
        if new is not None:
            lines[start - 1 : end] = new
    return "".join(lines)


def _refill_docstring(block: list[str]) -> list[str] | None:
    first = block[0]
    indent = first[: len(first) - len(first.lstrip())]
    m = re.match(r'^(\s*)([rRuU]?)("""|\'\'\')', first)
    if m is None:
        return None
    opener = m[2] + m[3]
    closer = m[3]
    text = "".join(block)
    body = text[len(indent) + len(opener) : text.rstrip().rfind(closer)]
    raw = body.split("\n")
    # Continuation lines carry the docstring's indentation; the first line does not.
    rows = [raw[0]] + [r[len(indent) :] if r.startswith(indent) else r.lstrip() for r in raw[1:]]
    out: list[str] = []
    para: list[str] = []
    hang = ""
    verbatim = False

    def flush() -> None:
        nonlocal para, hang
        if para:
            # Room for the quotes: the opening ones before the first line, the closing ones
            # after a last line (the formatter joins them onto it).
            width = WIDTH - len(indent) - len(closer)
            first_width = width - (len(opener) if not out else 0)
            filled = _fill(" ".join(para), "", first_width, hang)
            if filled and not out:
                rest = " ".join(filled[1:])
                filled = filled[:1] + (_fill(rest, "", width, hang) if rest else [])
            out.extend(filled)
        para, hang = [], ""

    for row in rows:
        if not row.strip():
            flush()
            verbatim = False
            out.append("")
            continue
        if para and hang and row.startswith(hang) and not row[len(hang)].isspace():
            para.append(row.strip())  # a list item's next line
            continue
        if not verbatim and row.rstrip().endswith("::"):
            para.append(row.strip())  # prose that introduces a literal block
            flush()
            verbatim = True
            continue
        if verbatim or row.startswith((" ", "|", ">>>")):
            flush()
            out.append(row.rstrip())
            continue
        item = _LIST_ITEM.match(row)
        if item:
            flush()
            hang = " " * len(item[0])
        para.append(row.strip())
    flush()
    while out and not out[-1]:
        out.pop()
    trailing_newline = body.endswith("\n") or text.rstrip().endswith("\n" + indent + closer)
    lines = [indent + opener + out[0]] + [(indent + o) if o else "" for o in out[1:]]
    if trailing_newline or len(lines[-1]) + len(closer) > WIDTH:
        lines.append(indent + closer)
    else:
        lines[-1] += closer
    tail = text.rstrip()[text.rstrip().rfind(closer) + len(closer) :]
    lines[-1] += tail
    return [line + "\n" for line in lines]


def _shape(text: str) -> str:
    """The syntax tree with docstrings' whitespace normalized: what layout must not change."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    first.value.value = " ".join(first.value.value.split())
    return ast.dump(tree)


def layout(text: str, where: str) -> str:
    """``text`` in SGLang's layout (see the module docstring)."""
    # Trailing comments first: left in place, the formatter breaks their code to fit them.
    out = ruff_format(wrap_comments(text))
    out = split_strings(out)
    out = wrap_comments(out)
    out = wrap_docstrings(out)
    out = ruff_format(out)
    if _shape(out) != _shape(text):
        raise LayoutError(f"{where}: laying it out changed the program")
    return out


def long_lines(text: str) -> list[int]:
    """The 1-based numbers of lines past ``WIDTH``."""
    return [i for i, line in enumerate(text.splitlines(), 1) if len(line) > WIDTH]
