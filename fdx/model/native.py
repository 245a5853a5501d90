"""Build (at install time, else once per machine) and load fdx's C++ CPU ops (fdx/csrc/) as Paddle custom ops.

The sources ship inside the package (``fdx/csrc`` is package data, so a
wheel or sdist install builds them too, not only a repo checkout).
The fp32 kernels are written once against fdx/csrc/simd_math.h, a small SIMD layer
with two implementations chosen at build time: **AVX-512F** (16 lanes) where
the CPU has it, else **AVX2 + FMA + F16C** (8 lanes).  :func:`cpu_isa` picks
the set from ``/proc/cpuinfo`` (``FDX_NATIVE_ISA=avx2`` forces the AVX2 set
on an AVX-512 CPU, e.g. to test it).  The int8 GEMM (csrc/qgemm.cc) uses
AVX2's ``vpmaddubsw``, or ``vpdpbusd`` where the build targets AVX-512-VNNI
or AVX-VNNI (the same exact integer sums), and on a CPU with AMX-INT8 (an
AVX-512 build there targets it) its tiles of 16 rows run ``tdpbssd`` on the
tile unit -- again the same integers, the same bits; ``FDX_NATIVE_AMX=0``
turns that off (read per call).  :func:`load_ops` logs one line
naming the kernels it loaded (:func:`describe`), and a CPU with neither
set falls back with one log line.

**Built at install time.**  ``python -m fdx.model.native`` (``make install``
runs it after ``pip install``) builds the ops for this machine's kernel set
into the installed package, ``fdx/_ops/<isa>-<hash>``, with
:func:`fdx.model.ops_build.compile_op_library` (one compiler per core; the
kernels are plain C++, only csrc/paddle_ops.cc includes Paddle: ~12 s on 2
cores); :func:`load_ops`
loads such a build straight from its ``.so`` (about a second, no compiler
run), so ``fdx serve`` starts without compiling, whatever
``$FDX_CACHE_DIR`` holds.  Other builds (``FDX_NATIVE_ISA=avx2`` on an
AVX-512 CPU, a changed source) are JIT-built and cached under
``$FDX_CACHE_DIR`` (default ``~/.cache/fdx``) in ``ops/<isa>-<hash>``.
The hash covers the sources, Paddle's version, the flags, the ISA and the
CPU's flags, so a build for one kernel set is never loaded on a CPU that
needs the other; a file lock makes concurrent processes build it once.
``fdx serve`` never compiles (it sets ``FDX_NATIVE_BUILD=0`` unless the
environment says otherwise): with no build for this machine it logs a
warning naming the command above and falls back.  When the compiler is
missing or the build fails, :func:`load_ops` returns ``None`` and the model
falls back to pure Paddle ops (slower, float32 compute, same results);
``FDX_NATIVE_OPS=0`` asks for that fallback.

Ops: ``fdx_paged_attention`` (csrc/paged_attention.cc: RoPE + KV write +
paged causal attention), ``fdx_qgemv`` (csrc/qgemv.cc: fp32 few-row matmul
straight from GGUF Q4_0/Q4_1/Q8_0 blocks), ``fdx_qgemm`` (csrc/qgemm.cc:
the batch-invariant int8 GEMM over packed blocks, every row count),
``fdx_add_rms_norm`` and
``fdx_swiglu`` (csrc/small_ops.cc), and ``fdx_decoder_layers``
(csrc/paddle_ops.cc: every decoder layer of an int8 step in one call,
through the same kernels, whose plain C++ entry points csrc/kernels.h
declares), and ``fdx_moe`` (csrc/moe.cc: a mixture-of-experts block --
router, top-k, the grouping by expert, both expert GEMMs and the weighted
sum -- in one call, for int8, bf16 and float32); and two plain C entry
points called with ctypes, ``fdx_sample_rows`` and ``fdx_logprobs_rows``
(csrc/sampling.cc, :class:`SamplingKernel`).  They use OpenMP through
Paddle's libiomp5 -- the runtime MKL uses -- never libgomp (so no
``omp for schedule(dynamic)``: its GOMP entry points are libgomp's only).
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

#: the C++ sources, inside the installed package (package data)
CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
#: builds made at install time (``python -m fdx.model.native``), inside the installed package
PREBUILT = os.path.join(os.path.dirname(CSRC), "_ops")
BUILD_COMMAND = f"{os.path.basename(sys.executable) or 'python'} -m fdx.model.native"
SOURCES = ("paddle_ops.cc", "paged_attention.cc", "qgemv.cc", "qgemm.cc", "small_ops.cc", "moe.cc", "sampling.cc")
HEADERS = ("simd_math.h", "kernels.h")
#: plain C libraries beside the op module (ctypes, not Paddle ops): tensor parallelism's collectives
STANDALONE = ("tp_comm.cc",)
#: -g0: no debug info (Python's build flags ask for -g): a third of each file's compile time
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-fno-associative-math",
          "-ffp-contract=off", "-g0")

#: extra compiler flags per kernel set (-march=native targets the CPU; the
#: -D guard makes csrc/simd_math.h fail the build if the target disagrees)
ISA_CFLAGS = {
    "avx512": ("-DFDX_EXPECT_AVX512",),
    "avx2": ("-mno-avx512f", "-DFDX_EXPECT_AVX2"),
}

_ops: Any = None
_isa: str | None = None
_dot: str | None = None
_bf16_dot: str | None = None
_tried = False
#: the loaded op module's shared library (its plain C entry points are called with ctypes)
_so_path: str | None = None
_sampling: "SamplingKernel | None" = None


def cache_dir() -> str:
    return os.environ.get("FDX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fdx")


def load_ops() -> Any:
    """The compiled op module, or ``None`` if it cannot be built here
    (``FDX_NATIVE_OPS=0`` disables it)."""
    global _ops, _isa, _dot, _bf16_dot, _tried
    if _tried:
        return _ops
    _tried = True
    if os.environ.get("FDX_NATIVE_OPS", "1") == "0":
        return None
    isa = cpu_isa()
    if isa is None:
        log.warning("fdx native CPU ops need AVX-512F or AVX2+FMA+F16C, which this CPU lacks; using pure Paddle ops")
        return None
    try:
        _ops = _build(isa, compile_ok=os.environ.get("FDX_NATIVE_BUILD", "1") != "0")
    except OpsNotBuilt as exc:
        log.warning("%s; using pure Paddle ops (slower; --dtype auto runs float32)", exc)
        _ops = None
        return None
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the fallback"
        log.warning("fdx native CPU ops unavailable (%s: %s); using pure Paddle ops", type(exc).__name__, exc)
        _ops = None
        return None
    _isa = isa
    _dot, _bf16_dot = _dot_products(_ops)
    log.info("fdx native CPU ops: %s", describe())
    if amx_unused_reason() is not None:
        log.warning("%s", amx_unused_reason())
    return _ops


def amx_unused_reason() -> str | None:
    """Why the int8 GEMM does not use the AMX-INT8 this CPU has (a speed
    loss only: the VNNI tiles give the same bits), or ``None`` when it does,
    when the CPU has none, or when ``FDX_NATIVE_AMX=0`` turned it off."""
    if (_ops is None or _isa != "avx512" or os.environ.get("FDX_NATIVE_AMX") == "0"
            or not {"amx_tile", "amx_int8"} <= set(_cpu_flags().split()) or loaded_int8_amx()):
        return None
    return ("this CPU has AMX-INT8 but the int8 GEMM runs without it (Linux refused the tile data state "
            "(arch_prctl ARCH_REQ_XCOMP_PERM), or the ops were built without -mamx-int8): the same bits, "
            "slower at 16+ rows")


def describe() -> str:
    """The loaded kernels in words, e.g. ``"avx2 kernel set (fp32: 8 lanes;
    int8: vpmaddubsw; bf16: fma, no AVX512-BF16)"``."""
    if _ops is None:
        return "none (pure Paddle ops)"
    lanes = 16 if _isa == "avx512" else 8
    bf16 = "vdpbf16ps" if _bf16_dot == "vdpbf16ps" else "fma, no AVX512-BF16"
    amx = " + AMX tdpbssd at 16+ rows" if loaded_int8_amx() else ""
    return f"{_isa} kernel set (fp32: {lanes} lanes; int8: {_dot}{amx}; bf16: {bf16})"


def _float32_rows(raw: Any) -> Any:
    """``raw`` as the kernels read it: float32 rows with a unit column stride
    (any row stride: the padded vocabulary's view stays a view), else a copy."""
    import numpy as np

    return raw if raw.dtype == np.float32 and raw.strides[1] == 4 else np.ascontiguousarray(raw, dtype=np.float32)


class SamplingKernel:
    """``fdx_sample_rows``, ``fdx_logprobs_rows`` and ``fdx_argmax_rows``
    (fdx/csrc/sampling.cc) of the loaded ops, called with ctypes on NumPy
    buffers: the temperature / min_p / top_k / top_p rows of a step, one
    token each (:meth:`fdx.model.sampler.Sampler._sample_random`), the
    logprobs of the rows that ask for them
    (:meth:`fdx.model.sampler.Sampler._logprobs`), and the greedy rows."""

    def __init__(self, so_path: str) -> None:
        import ctypes

        lib = ctypes.CDLL(so_path)
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.fdx_sample_rows
        self._fn.argtypes = [p, i64, p, i64, i64, p, p, p, p, p, p]
        self._fn.restype = ctypes.c_int
        self._lp = lib.fdx_logprobs_rows
        self._lp.argtypes = [p, i64, p, i64, i64, p, i64, p, p, p]
        self._lp.restype = ctypes.c_int
        self._am = lib.fdx_argmax_rows
        self._am.argtypes = [p, i64, i64, i64, p]
        self._am.restype = ctypes.c_int

    def __call__(self, raw: Any, rows: Any, inv_t: Any, top_k: Any, top_p: Any, min_p: Any, u: Any) -> Any:
        """Tokens ``int64[len(rows)]``: row ``j`` samples ``raw[rows[j]]``
        (``raw``: float32 ``[n, V]``, unit column stride) with ``inv_t[j]``,
        ``top_k[j]`` (0: off, else < V), ``top_p[j]``, ``min_p[j]`` and the
        uniform draw ``u[j]`` in (0, 1]."""
        import numpy as np

        raw = _float32_rows(raw)
        n = len(rows)
        args = (np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(inv_t, dtype=np.float32),
                np.ascontiguousarray(top_k, dtype=np.int64), np.ascontiguousarray(top_p, dtype=np.float64),
                np.ascontiguousarray(min_p, dtype=np.float32), np.ascontiguousarray(u, dtype=np.float64))
        out = np.empty(n, dtype=np.int64)
        if n:
            self._fn(raw.ctypes.data, raw.strides[0] // 4, args[0].ctypes.data, n, raw.shape[1],
                     *(a.ctypes.data for a in args[1:]), out.ctypes.data)
        return out

    def argmax(self, raw: Any) -> Any:
        """Each row's greedy token, ``int64[n]``, as ``raw.argmax(axis=1)``
        (the first largest value, or the first NaN), the rows spread over
        the OpenMP team (``raw``: float32 ``[n, V]``)."""
        import numpy as np

        raw = _float32_rows(raw)
        out = np.empty(raw.shape[0], dtype=np.int64)
        if raw.shape[0]:
            self._am(raw.ctypes.data, raw.strides[0] // 4, raw.shape[0], raw.shape[1], out.ctypes.data)
        return out

    def logprobs(self, raw: Any, rows: Any, tokens: Any, k: int) -> tuple[Any, Any, Any]:
        """Row ``j``'s logprobs from ``raw[rows[j]]`` (the raw logits): the
        chosen ``tokens[j]``'s (float64 ``[n]``) and the ``k`` largest
        (``[n, k]`` ids and float64 logprobs, largest first, ties by id)."""
        import numpy as np

        raw = _float32_rows(raw)
        n = len(rows)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        chosen = np.empty(n, dtype=np.float64)
        ids = np.zeros((n, k), dtype=np.int64)
        vals = np.zeros((n, k), dtype=np.float64)
        if n:
            self._lp(raw.ctypes.data, raw.strides[0] // 4, rows.ctypes.data, n, raw.shape[1], tokens.ctypes.data, k,
                     chosen.ctypes.data, ids.ctypes.data, vals.ctypes.data)
        return chosen, ids, vals


def sampling_kernel() -> SamplingKernel | None:
    """The native sampler of the loaded ops, or ``None`` when they are not loaded."""
    global _sampling
    if _ops is None or _so_path is None:
        return None
    if _sampling is None:
        _sampling = SamplingKernel(_so_path)
    return _sampling


def loaded_int8_dot() -> str | None:
    """The int8 GEMM's dot product instruction (``"vpdpbusd"``/``"vpmaddubsw"``), or ``None``."""
    return _dot if _ops is not None else None


def loaded_int8_amx() -> bool:
    """Whether the int8 GEMM runs its tiles of 16 rows on AMX now (the build
    targets AMX-INT8, the CPU and Linux allow it, ``FDX_NATIVE_AMX`` is not ``0``)."""
    if _ops is None:
        return False
    import paddle

    flags = _ops.fdx_qgemm_dot(paddle.zeros([1], "float32")).numpy()
    return len(flags) > 2 and int(flags[2]) == 1


def loaded_bf16_dot() -> str | None:
    """The bf16 GEMM's dot product (``"vdpbf16ps"``, or ``"fma"``: two fmas a pair), or ``None``."""
    return _bf16_dot if _ops is not None else None


def _dot_products(ops: Any) -> tuple[str, str]:
    import paddle

    flags = ops.fdx_qgemm_dot(paddle.zeros([1], "float32")).numpy()
    return ("vpdpbusd" if int(flags[0]) == 1 else "vpmaddubsw"), ("vdpbf16ps" if int(flags[1]) == 1 else "fma")


def loaded_isa() -> str | None:
    """The kernel set of the loaded ops (``"avx512"``/``"avx2"``), or ``None``."""
    return _isa if _ops is not None else None


def cpu_isa() -> str | None:
    """The kernel set this CPU runs: ``"avx512"`` (AVX-512F), ``"avx2"``
    (AVX2 + FMA + F16C), or ``None``.  ``FDX_NATIVE_ISA=avx2`` picks the AVX2
    set on an AVX-512 CPU; asking for a set the CPU lacks gives ``None``."""
    flags = set(_cpu_flags().split())
    has = {
        "avx512": "avx512f" in flags and "f16c" in flags,
        "avx2": {"avx2", "fma", "f16c"} <= flags,
    }
    want = os.environ.get("FDX_NATIVE_ISA", "").strip().lower()
    if want:
        if want not in has:
            raise ValueError(f"FDX_NATIVE_ISA={want!r}: choose one of {sorted(has)}")
        return want if has[want] else None
    for isa in ("avx512", "avx2"):
        if has[isa]:
            return isa
    return None


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
    """Whether this CPU runs AVX-512F code (Paddle's fused CPU RMSNorm kernel
    needs it and dies with SIGILL where it is missing; fdx's own ops have an
    AVX2 set too, see :func:`cpu_isa`)."""
    return "avx512f" in _cpu_flags().split()


class OpsNotBuilt(RuntimeError):
    """No build of the ops for this machine, and compiling is not allowed here."""


def _build(isa: str, sources: tuple[str, ...] | None = None, name: str = "fdx_ops", compile_ok: bool = True,
           into_package: bool = False) -> Any:
    """Build (or load an existing build of) the ops for kernel set ``isa``:
    fdx/csrc's sources, or ``sources`` (paths; e.g. the scalar reference of
    tests/csrc, built with the very same flags), as module ``name``.  An
    install-time build (:data:`PREBUILT`) or a cached one is loaded from its
    ``.so``; otherwise the ops are compiled (into the package with
    ``into_package``, else the cache) or, without ``compile_ok``,
    :class:`OpsNotBuilt` is raised."""
    from fdx.logs import import_paddle_quietly

    import_paddle_quietly()  # the OMP_NUM_THREADS notice goes to the log
    import paddle

    paths = [os.path.join(CSRC, s) for s in SOURCES] if sources is None else list(sources)
    h = hashlib.sha256()
    for p in paths + [os.path.join(CSRC, x) for x in HEADERS]:
        with open(p, "rb") as f:
            h.update(f.read())
    cflags = CFLAGS + ISA_CFLAGS[isa]
    h.update(paddle.__version__.encode())
    h.update(isa.encode())
    h.update(" ".join(cflags + tuple(_ldflags())).encode())
    h.update(sys.version.encode())
    h.update(_cpu_flags().encode())  # -march=native builds are CPU specific
    h.update(CSRC.encode())  # Paddle's loader rebuilds when the include path differs: one dir per checkout
    key = h.hexdigest()[:16]
    sub = f"{isa}-{key}" if sources is None else f"{name}-{isa}-{key}"
    module = f"{name}_{isa}_{key}"
    cached = os.path.join(cache_dir(), "ops", sub)
    packaged = os.path.join(PREBUILT, sub)
    if into_package and not _is_built(packaged, module) and _is_built(cached, module):
        import shutil

        shutil.copytree(cached, packaged, dirs_exist_ok=True)  # the same build: no need to compile it again
    for d in ([packaged] if sources is None else []) + ([] if into_package else [cached]):
        if _is_built(d, module):
            try:
                return _load_built(d, module)
            except Exception as exc:  # noqa: BLE001 - a broken build: rebuild it below (or report)
                log.debug("fdx native ops in %s did not load (%s: %s)", d, type(exc).__name__, exc)
    if not compile_ok:
        raise OpsNotBuilt(f"fdx native CPU ops are not built for this machine ({isa} kernel set; looked in "
                          f"{packaged} and {cached}); build them once with `{BUILD_COMMAND}` (make install does)")
    from fdx.model.ops_build import compile_op_library

    build_dir = packaged if into_package else cached
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_built(build_dir, module):  # a concurrent process may have built it while this one waited
            compile_op_library(module, paths, list(cflags), _ldflags(), [CSRC], build_dir)
    return _load_built(build_dir, module)


def _is_built(build_dir: str, module: str) -> bool:
    return os.path.isfile(os.path.join(build_dir, module, module + ".so"))


def _load_built(build_dir: str, module: str) -> Any:
    """Import a finished build's ``.so`` as the op module (no compiler run;
    writes only Paddle's small generated Python API file next to it)."""
    from paddle.utils.cpp_extension import extension_utils

    global _so_path
    with open(os.path.join(build_dir, ".lock"), "a") as lock:  # a concurrent build of the same key finishes first
        fcntl.flock(lock, fcntl.LOCK_SH)
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), _muted_paddle_logs():
            warnings.simplefilter("ignore")
            mod = extension_utils._import_module_from_library(module, os.path.join(build_dir, module), False)
    if module.startswith("fdx_ops_"):
        _so_path = os.path.join(build_dir, module, module + ".so")
    return mod


def build_library(source: str, into_package: bool = False) -> str:
    """The path of ``fdx/csrc/<source>`` built as a plain shared library
    (:data:`STANDALONE`, loaded with ctypes): the install-time build in the
    package, else one built once (a second of g++) into the cache dir;
    ``into_package`` builds it into the package."""
    import shutil
    import subprocess

    path = os.path.join(CSRC, source)
    with open(path, "rb") as f:
        key = hashlib.sha256(f.read()).hexdigest()[:16]
    stem = os.path.splitext(source)[0]
    lib = f"libfdx_{stem}.so"
    packaged = os.path.join(PREBUILT, f"{stem}-{key}")
    d = packaged if into_package or os.path.exists(os.path.join(packaged, lib)) else os.path.join(cache_dir(), stem, key)
    os.makedirs(d, exist_ok=True)
    so = os.path.join(d, lib)
    with open(os.path.join(d, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(so):
            cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
            if cxx is None:
                raise RuntimeError(f"building fdx/csrc/{source} needs a C++ compiler (g++)")
            tmp = so + f".{os.getpid()}.tmp"
            r = subprocess.run([cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-o", tmp, path],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"building fdx/csrc/{source} failed: {r.stderr.strip().splitlines()[-1:]}")
            os.replace(tmp, so)
    return so


def main(argv: list[str] | None = None) -> int:
    """``python -m fdx.model.native``: build the ops for this machine's kernel
    set into the installed package (``make install`` runs it), so that
    ``fdx serve`` never compiles them."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fdx.model.native", description=main.__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    isa = cpu_isa()
    if isa is None:
        print("fdx: this CPU has neither AVX-512F nor AVX2+FMA+F16C; fdx runs pure Paddle ops (nothing to build)")
        return 0
    try:
        ops = _build(isa, into_package=True)
    except Exception as exc:  # noqa: BLE001 - one line, the fallback still works
        print(f"fdx: building the native CPU ops failed ({type(exc).__name__}: {exc}); fdx serve will use pure Paddle ops",
              file=sys.stderr)
        return 1
    for src in STANDALONE:
        build_library(src, into_package=True)
    global _ops, _isa, _dot, _bf16_dot, _tried
    _ops, _isa, _tried = ops, isa, True
    _dot, _bf16_dot = _dot_products(ops)
    print(f"fdx native CPU ops built into {PREBUILT}: {describe()}")
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
