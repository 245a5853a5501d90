"""JIT-build and load fdx's C++ CPU ops (csrc/) with ``paddle.utils.cpp_extension``.

The build is cached under ``$FDX_CACHE_DIR`` (default ``~/.cache/fdx``) in
a folder keyed by a hash of the sources, Paddle's version and the flags, and
guarded by a file lock so concurrent processes build it once.  When the
compiler is missing or the build fails (the kernels need AVX-512F and F16C),
:func:`load_ops` returns ``None`` and the model falls back to pure Paddle ops
(slower, same results).

Ops: ``fdx_paged_attention`` (csrc/paged_attention.cc: RoPE + KV write +
paged causal attention), ``fdx_qgemv`` (csrc/qgemv.cc: few-row matmul
straight from GGUF Q4_0/Q4_1/Q8_0 blocks), ``fdx_add_rms_norm`` and
``fdx_swiglu`` (csrc/small_ops.cc).  Both use OpenMP through Paddle's
libiomp5 -- the runtime MKL uses -- never libgomp.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import logging
import os
import sys
import warnings
from typing import Any

log = logging.getLogger("fdx.model")

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")
SOURCES = ("paged_attention.cc", "qgemv.cc", "small_ops.cc")
HEADERS = ("simd_math.h",)
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only")

_ops: Any = None
_tried = False


def cache_dir() -> str:
    return os.environ.get("FDX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fdx")


def load_ops() -> Any:
    """The compiled op module, or ``None`` if it cannot be built here
    (``FDX_NATIVE_OPS=0`` disables it)."""
    global _ops, _tried
    if _tried:
        return _ops
    _tried = True
    if os.environ.get("FDX_NATIVE_OPS", "1") == "0":
        return None
    if not has_avx512():
        log.warning("fdx native CPU ops need AVX-512, which this CPU lacks; using pure Paddle ops")
        return None
    try:
        _ops = _build()
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the fallback"
        log.warning("fdx native CPU ops unavailable (%s: %s); using pure Paddle ops", type(exc).__name__, exc)
        _ops = None
    return _ops


def _ldflags() -> list[str]:
    """Link OpenMP against Paddle's own libiomp5 (the runtime MKL uses), not
    libgomp: two OpenMP runtimes spin-waiting on 2 cores starve each other
    (measured 100x slower GEMV)."""
    import paddle

    libs = os.path.join(os.path.dirname(paddle.__file__), "libs")
    if os.path.exists(os.path.join(libs, "libiomp5.so")):
        return [f"-L{libs}", "-l:libiomp5.so", f"-Wl,-rpath,{libs}"]
    return ["-fopenmp"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def has_avx512() -> bool:
    """Whether this CPU runs AVX-512F code (the C++ ops and Paddle's fused
    CPU RMSNorm kernel use it; they die with SIGILL where it is missing)."""
    return " avx512f" in _cpu_flags()


def _build() -> Any:
    import paddle

    with warnings.catch_warnings():  # "No ccache found" on import
        warnings.simplefilter("ignore")
        from paddle.utils import cpp_extension

    paths = [os.path.join(CSRC, s) for s in SOURCES]
    h = hashlib.sha256()
    for p in paths + [os.path.join(CSRC, x) for x in HEADERS]:
        with open(p, "rb") as f:
            h.update(f.read())
    h.update(paddle.__version__.encode())
    h.update(" ".join(CFLAGS + tuple(_ldflags())).encode())
    h.update(sys.version.encode())
    h.update(_cpu_flags().encode())  # -march=native builds are CPU specific
    key = h.hexdigest()[:16]
    build_dir = os.path.join(cache_dir(), "ops", key)
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), warnings.catch_warnings(), _muted_paddle_logs():
            warnings.simplefilter("ignore")
            return cpp_extension.load(
                name="fdx_ops_" + key,
                sources=paths,
                extra_cxx_cflags=list(CFLAGS),
                extra_ldflags=_ldflags(),
                extra_include_paths=[CSRC],
                build_directory=build_dir,
                verbose=False,
            )


@contextlib.contextmanager
def _muted_paddle_logs() -> Any:
    """Paddle's extension loader logs "using custom operator only" at INFO."""
    from paddle.utils.cpp_extension import extension_utils

    logger = getattr(extension_utils, "logger", None)
    old = logger.level if logger is not None else None
    if logger is not None:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        if logger is not None and old is not None:
            logger.setLevel(old)
