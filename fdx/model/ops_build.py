"""Compile C++ sources into a Paddle custom-op library, one compiler per core.

:func:`compile_op_library` is what ``paddle.utils.cpp_extension.load``
does for a CPU extension, without its detour: that writes a ``setup.py``
and runs it in a second Python (another ``import paddle``, about 4 s, and
its "No ccache found" warning on stderr), and compiles through setuptools.
Here each source is one compiler process, as many at once as the machine
has cores, with Paddle's own include and library directories and the
defines its extensions need (``PADDLE_WITH_CUSTOM_KERNEL``,
``PADDLE_EXTENSION_NAME``, the C++11 ABI); the result is
``<build_dir>/<module>/<module>.so``, which
``extension_utils._import_module_from_library`` loads (the layout
``cpp_extension.load`` leaves).

Only the sources that define Paddle ops (``PD_BUILD_OP``) need Paddle's
headers, whose parsing and inline functions cost ~6 s a file; fdx/csrc keeps
them in one file (``paddle_ops.cc``) and the kernels in plain C++.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sysconfig

#: flags every object gets (setuptools' defaults that change code: no asserts, wrapping signed overflow)
BASE_FLAGS = ("-std=c++17", "-fPIC", "-w", "-DNDEBUG", "-fwrapv", "-D_GLIBCXX_USE_CXX11_ABI=1")


class BuildError(RuntimeError):
    """The compiler failed (the message names the file and the compiler's first error)."""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise BuildError("building fdx's C++ ops needs a C++ compiler (g++)")
    return cxx


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:  # one line: the compiler's first error (else its last line)
        lines = (r.stderr or r.stdout or "").strip().splitlines() or ["no output"]
        first = next((ln for ln in lines if "error" in ln), lines[-1])
        raise BuildError(f"compiling {what} failed: {first.strip()}")


def compile_op_library(module: str, sources: list[str], cflags: list[str], ldflags: list[str],
                       include_dirs: list[str], build_dir: str) -> str:
    """Build ``sources`` into ``<build_dir>/<module>/<module>.so`` (returned);
    :class:`BuildError` names the source that failed."""
    from fdx.logs import import_paddle_quietly

    import_paddle_quietly()  # its "No ccache found" (on importing cpp_extension) goes to the debug log
    from paddle.utils.cpp_extension import extension_utils as eu

    cxx = _compiler()
    out_dir = os.path.join(build_dir, module)
    obj_dir = os.path.join(build_dir, "obj")
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(obj_dir, exist_ok=True)
    includes = [f"-I{d}" for d in [*include_dirs, *eu.find_paddle_includes(), sysconfig.get_path("include")]]
    flags = [*BASE_FLAGS, *cflags, "-DPADDLE_WITH_CUSTOM_KERNEL", f"-DPADDLE_EXTENSION_NAME={module}", *includes]

    def compile_one(src: str) -> str:
        obj = os.path.join(obj_dir, os.path.splitext(os.path.basename(src))[0] + ".o")
        _run([cxx, *flags, "-c", src, "-o", obj], os.path.basename(src))
        return obj

    # the longest first, so the last compiler to start is a short one
    order = sorted(sources, key=lambda s: -os.path.getsize(s))
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(order), os.cpu_count() or 1))) as pool:
        objs = dict(zip(order, pool.map(compile_one, order)))
    lib_dirs = eu.find_paddle_libraries()
    so = os.path.join(out_dir, module + ".so")
    tmp = f"{so}.{os.getpid()}.tmp"
    _run([cxx, "-shared", *[objs[s] for s in sources], *[f"-L{d}" for d in lib_dirs],
          *[f"-Wl,-rpath,{d}" for d in lib_dirs], *ldflags, "-Wl,--no-as-needed", f"-l:{eu._get_core_name()}",
          "-Wl,--as-needed", "-o", tmp], f"{module}.so")
    os.replace(tmp, so)
    shutil.rmtree(obj_dir, ignore_errors=True)
    return so
