"""The two kernel sets of fdx's C++ CPU ops give the same bits.

fdx/csrc/ builds for AVX-512 (16 float lanes, vpdpbusd, vdpbf16ps where the
CPU has them) or for AVX2 (8 lanes, vpmaddubsw, two fmas a bf16 pair).  Every
floating-point reduction runs in the 16 canonical lanes of simd_math.h with
one fixed tree, and the int8 and bf16 GEMMs run one per-element sequence, so
the int8 and bf16 modes answer a prompt with the same tokens and logprobs on
every CPU.  Where this CPU has both sets, both run (``FDX_NATIVE_ISA=avx2``
and the default, each in a subprocess) and are compared: every op on fixed
inputs (tests/isa_bits_probe.py), then a real generation with the embedded
model in both modes.  A CPU with only one set cannot run the other; there
the scalar-reference tests (tests/test_scalar_reference.py) stand in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from fdx.model import native

_FLAGS = set(native._cpu_flags().split())
_BOTH = "avx512f" in _FLAGS and {"avx2", "fma", "f16c"} <= _FLAGS
pytestmark = pytest.mark.skipif(
    not _BOTH or os.environ.get("FDX_NATIVE_OPS") == "0",
    reason="needs a CPU with both kernel sets (AVX-512F and AVX2+FMA+F16C) and the native ops enabled",
)
HERE = os.path.dirname(os.path.abspath(__file__))


def _run(isa: str, args: list[str], timeout: int = 900) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, FDX_NATIVE_ISA=isa)
    r = subprocess.run([sys.executable, *args], env=env, capture_output=True, timeout=timeout)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return r


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("isa")
    out = {}
    for isa in ("avx2", "avx512"):
        path = str(d / f"{isa}.npz")
        _run(isa, [os.path.join(HERE, "isa_bits_probe.py"), path])
        out[isa] = np.load(path)
    return out


def test_every_op_gives_the_same_bits_with_both_sets(probes: dict[str, Any]) -> None:
    a, b = probes["avx2"], probes["avx512"]
    assert str(a["isa"]) == "avx2" and str(b["isa"]) == "avx512"
    assert sorted(a.files) == sorted(b.files) and len(a.files) > 100
    differ = [k for k in a.files if k != "isa" and a[k].tobytes() != b[k].tobytes()]
    assert not differ, f"{len(differ)} op outputs differ between the kernel sets: {differ[:12]}"


_GENERATE = r"""
import json, sys
import fdx
from fdx.model import native
q = [[{"role": "user", "content": "What is the capital of France?"}],
     [{"role": "user", "content": "Write a haiku about the sea."}],
     [{"role": "user", "content": "def fibonacci(n):"}]]
out = {}
for dtype in ("int8", "bfloat16"):
    llm = fdx.LLM(dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=64)
    res = llm.chat(q, fdx.SamplingParams(temperature=0, max_tokens=40, logprobs=3))
    out[dtype] = [{"text": r.outputs[0].text, "ids": r.outputs[0].token_ids,
                   "lp": [[lp.token_id, lp.logprob.hex(), [[t[0], float(t[1]).hex()] for t in lp.top]]
                          for lp in r.outputs[0].logprobs]} for r in res]
out["isa"] = native.loaded_isa()
sys.stdout.write(json.dumps(out))
"""


@pytest.mark.slow
def test_int8_and_bf16_generations_are_bit_identical_with_both_sets() -> None:
    """The README's first question and two more, batched (prefill chunks of
    64 tokens beside decodes): the same tokens, and every logprob (the
    chosen token's and the top 3) to the last bit."""
    got = {isa: json.loads(_run(isa, ["-c", _GENERATE]).stdout) for isa in ("avx2", "avx512")}
    assert got["avx2"].pop("isa") == "avx2" and got["avx512"].pop("isa") == "avx512"
    for dtype in ("int8", "bfloat16"):
        a, b = got["avx2"][dtype], got["avx512"][dtype]
        assert [r["ids"] for r in a] == [r["ids"] for r in b], (dtype, [r["text"] for r in a], [r["text"] for r in b])
        assert a == b, dtype
        assert all(len(r["ids"]) > 3 for r in a)


#: runs a script with the AVX2 set built without AVX-VNNI (-mno-avxvnni: another
#: build hash), so the int8 GEMM takes its vpmaddubsw path; prints the dot product
_NO_VNNI = r"""
import runpy, sys
from fdx.model import native
native.ISA_CFLAGS["avx2"] = native.ISA_CFLAGS["avx2"] + ("-mno-avxvnni",)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
sys.stdout.write("\n" + str(native.loaded_int8_dot()))
"""


@pytest.mark.skipif("avx_vnni" not in _FLAGS, reason="the avx2 set already runs vpmaddubsw here (no AVX-VNNI)")
def test_the_vpmaddubsw_path_gives_the_same_bits(probes: dict[str, Any], tmp_path: Any) -> None:
    """On a CPU with AVX-VNNI the avx2 set's int8 GEMM uses vpdpbusd too, so
    the vpmaddubsw code of AVX2-only CPUs (Zen 3) would never run: build the
    set without AVX-VNNI and compare every op with the avx512 set's (the
    two-level activations' int16 pair sums must stay exact there)."""
    path = str(tmp_path / "maddubs.npz")
    r = _run("avx2", ["-c", _NO_VNNI, os.path.join(HERE, "isa_bits_probe.py"), path])
    assert r.stdout.decode().strip().splitlines()[-1] == "vpmaddubsw"
    a, b = np.load(path), probes["avx512"]
    assert sorted(a.files) == sorted(b.files)
    differ = [k for k in a.files if k != "isa" and a[k].tobytes() != b[k].tobytes()]
    assert not differ, f"{len(differ)} op outputs differ between vpmaddubsw and the avx512 set: {differ[:12]}"
