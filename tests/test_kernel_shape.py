"""The kernel stays the loop and IPC: ``fdx/core`` has at most 1,500 lines
of code (docstrings, comments and blank lines not counted), imports nothing
from ``fdx.model``, and ``Engine.step()`` is at most 10 lines."""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "fdx" / "core"
SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    """Physical lines holding a token that is neither a comment nor a
    docstring (a string that is a whole statement)."""
    toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines: set[int] = set()
    for i, t in enumerate(toks):
        if t.type in SKIP:
            continue
        if t.type == tokenize.STRING:
            j = i - 1
            while j >= 0 and toks[j].type in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
                j -= 1
            starts_statement = j < 0 or toks[j].type == tokenize.NEWLINE or toks[j].string == ":"
            if starts_statement and toks[i + 1].type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                continue
        lines.update(range(t.start[0], t.end[0] + 1))
    return len(lines)


def test_code_line_counter() -> None:
    src = '"""Module doc."""\n\n# a comment\nimport os  # trailing\n\n\ndef f(x):\n    """Doc\n    more."""\n    s = """not a\n    docstring"""\n    return x\n'
    assert code_lines(src) == 5  # import, def, s = (2 lines), return


def test_kernel_is_at_most_1500_code_lines() -> None:
    counts = {p.name: code_lines(p.read_text()) for p in sorted(CORE.glob("*.py"))}
    assert sum(counts.values()) <= 1500, f"fdx/core has {sum(counts.values())} code lines: {counts}"


def test_kernel_imports_nothing_from_fdx_model() -> None:
    bad = []
    for p in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad += [f"{p.name}: {n}" for n in names if n == "fdx.model" or n.startswith("fdx.model.")]
    assert not bad, bad


def test_engine_step_is_at_most_10_lines() -> None:
    from fdx.core.engine import Engine

    src = textwrap.dedent(inspect.getsource(Engine.step))
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef)
    stmts = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body  # without the docstring
    body = textwrap.dedent("\n".join(src.splitlines()[stmts[0].lineno - 1 : fn.end_lineno]))
    assert 0 < code_lines(body) <= 10, body
