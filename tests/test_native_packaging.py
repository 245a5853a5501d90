"""The C++ CPU ops ship in the wheel and the sdist (fdx/csrc is package
data), and an installed (non-editable) fdx finds them inside the package,
so it builds the fast path too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from fdx.model import native

REPO = Path(__file__).resolve().parent.parent
WANT = sorted(f"fdx/csrc/{n}" for n in native.SOURCES + native.HEADERS + native.STANDALONE)


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout's tracked files in a private folder (a build writes build/ and egg-info next to them)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    dst = tmp_path_factory.mktemp("src")
    for f in filter(None, files):
        src = REPO / os.fsdecode(f)
        if src.is_file():
            (dst / os.fsdecode(f)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / os.fsdecode(f))
    return dst


def test_native_finds_the_sources_inside_the_package() -> None:
    import fdx

    assert Path(native.CSRC) == Path(fdx.__file__).parent / "csrc"
    for name in native.SOURCES + native.HEADERS:
        assert (Path(native.CSRC) / name).is_file(), name


def test_sdist_carries_the_csrc(source_copy: Path, tmp_path: Path) -> None:
    code = f"from setuptools import build_meta as b; print(b.build_sdist({str(tmp_path)!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=source_copy, check=True, capture_output=True, text=True)
    name = out.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as tf:
        names = sorted("/".join(n.split("/")[1:]) for n in tf.getnames() if "/fdx/csrc/" in n and not n.endswith("/"))
    assert names == WANT


@pytest.mark.slow
def test_wheel_carries_the_csrc_and_an_install_finds_it(source_copy: Path, tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(wheels)],
                   cwd=source_copy, check=True, capture_output=True)
    [whl] = list(wheels.glob("fdx-*.whl"))
    with zipfile.ZipFile(whl) as z:
        assert sorted(n for n in z.namelist() if n.startswith("fdx/csrc/")) == WANT
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--no-compile", "--target", str(target),
                    str(whl)], check=True, capture_output=True)
    probe = "import fdx.model.native as n, os; print(n.CSRC); print(all(os.path.isfile(os.path.join(n.CSRC, s)) for s in n.SOURCES + n.HEADERS))"
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    csrc, ok = out.stdout.split()
    assert Path(csrc).resolve().is_relative_to(target.resolve()) and ok == "True"


def test_an_install_time_build_loads_without_compiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build in the package (``python -m fdx.model.native``, run by ``make
    install``) is loaded from its .so, with an empty FDX_CACHE_DIR and the
    compiler never called (in a subprocess: one process loads the ops once);
    with no build anywhere and compiling refused (what ``fdx serve`` does)
    the error names the command that builds them."""
    isa = native.cpu_isa()
    if isa is None or os.environ.get("FDX_NATIVE_OPS") == "0" or native.load_ops() is None:
        pytest.skip("no native kernel set on this CPU")
    src = next(d for d in (Path(native.PREBUILT), Path(native.cache_dir()) / "ops")
               if d.is_dir() and any(p.name.startswith(f"{isa}-") for p in d.iterdir()))
    pkg = tmp_path / "pkg_ops"
    for d in src.iterdir():
        if d.name.startswith(f"{isa}-") and any(d.glob("*/*.so")):
            shutil.copytree(d, pkg / d.name)
    code = (
        "import sys\n"
        "from fdx.model import native, ops_build\n"
        f"native.PREBUILT = {str(pkg)!r}\n"
        "def no_compiler(*a, **k): raise AssertionError('compiled although a build was installed')\n"
        "ops_build.compile_op_library = no_compiler\n"
        f"ops = native._build({isa!r}, compile_ok=False)\n"
        "assert hasattr(ops, 'fdx_qgemm') and hasattr(ops, 'fdx_decoder_layers')\n"
        "print('loaded')\n"
    )
    env = dict(os.environ, FDX_CACHE_DIR=str(tmp_path / "empty-cache"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("loaded"), r.stderr[-2000:]
    monkeypatch.setenv("FDX_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(native, "PREBUILT", str(tmp_path / "nothing"))
    with pytest.raises(native.OpsNotBuilt, match=r"-m fdx\.model\.native"):
        native._build(isa, compile_ok=False)
