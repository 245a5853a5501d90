"""A past revision's C++ op source as one file, for the benches that build
it beside today's ops (bench_qgemm.py, bench_attention.py).

Until 2026-12-06 each fdx/csrc kernel file carried its own Paddle op
(``PD_BUILD_OP``); since then the kernels are plain C++ and every binding
is in fdx/csrc/paddle_ops.cc, one section per op, each headed
``// ---...--- <ops> (<kernel file>)``.  :func:`op_source` gives the kernel
file of either layout with its ops in it, so a bench can rename and build it
whatever revision it compares with.
"""

from __future__ import annotations

import re
from typing import Callable

_SECTION = re.compile(r"^// -{10,} (.*)$", re.M)
_CHECKED = re.compile(r"template <typename F>\nvoid checked\(F&& f\) \{.*?\n\}\n", re.S)


def op_source(show: Callable[[str], str], kernel: str) -> str:
    """``fdx/csrc/<kernel>`` at the revision ``show`` reads (``show(path)`` ->
    the file's text), with the Paddle ops of that file."""
    src = show(f"fdx/csrc/{kernel}")
    if "PD_BUILD_OP(" in src:
        return src
    ops = show("fdx/csrc/paddle_ops.cc")
    parts = _SECTION.split(ops)  # [before, title, body, title, body, ...]
    bodies = [body for title, body in zip(parts[1::2], parts[2::2]) if f"({kernel})" in title]
    if not bodies:
        raise SystemExit(f"no Paddle op of {kernel} in that revision's paddle_ops.cc")
    checked = _CHECKED.search(ops)
    helper = f"namespace {{\n{checked.group(0)}}}  // namespace\n" if checked else ""
    return (src + "\n#include <stdexcept>\n#include <vector>\n\n#include \"paddle/extension.h\"\n\n"
            "using Tensors = std::vector<paddle::Tensor>;\n\n" + helper + "".join(bodies))
