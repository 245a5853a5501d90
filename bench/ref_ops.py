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
# the helpers every op section may call: paddle_ops.cc's first anonymous
# namespace (checked, the weight and cache checks, ...), with the fdx
# declarations just before it (TPComm) where the revision has them
_HELPERS = re.compile(r"^(?:namespace fdx \{\n.*?^\}  // namespace fdx\n\n)?namespace \{\n.*?^\}  // namespace\n",
                      re.S | re.M)


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
    found = _HELPERS.search(ops)
    helpers = found.group(0) if found else ""
    alias = "" if "using Tensors =" in helpers else "using Tensors = std::vector<paddle::Tensor>;\n\n"
    return (src + "\n#include <stdexcept>\n#include <vector>\n\n#include \"paddle/extension.h\"\n\n" + alias
            + helpers + "".join(bodies))
