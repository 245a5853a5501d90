"""Per-model sampling defaults (``--generation-config``,
``--override-generation-config``), as vLLM has them.

A request that leaves a sampling field out gets the model's default for it,
not the OpenAI one (temperature 1.0, top_p 1.0): a small model sampled at
temperature 1 rambles.  The defaults come from, in this order (later wins):

* ``--generation-config auto`` (the default): the model folder's
  ``generation_config.json`` (a Hugging Face folder), or the defaults fdx
  ships for a known model (:data:`KNOWN_MODELS`: the embedded SmolLM2, whose
  model card samples at temperature 0.2, top_p 0.9);
  ``vllm``: no model defaults; a PATH: that ``generation_config.json`` (or
  the folder holding one);
* ``--override-generation-config JSON``: keys of :data:`SAMPLING_KEYS`.

Only the keys in :data:`SAMPLING_KEYS` become defaults.  Other keys of a
``generation_config.json`` (``bos_token_id``, ``do_sample``, ...) are listed
in :attr:`GenerationDefaults.ignored` and logged at start-up; an override key
fdx does not implement is a :class:`ConfigError`.  A field the request sets
always wins.  ``max_new_tokens`` caps a request that sets no ``max_tokens``
(chat: otherwise the rest of the context; completions: otherwise 16); in
vLLM it caps every request, here a request's own ``max_tokens`` wins.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

import attrs

from fdx.core.errors import ConfigError

#: generation_config.json key -> GenerationDefaults field (the keys vLLM maps too)
SAMPLING_KEYS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}

#: ``--generation-config auto`` for a model without a generation_config.json
#: of its own: the sampling its model card recommends (SmolLM2-135M-Instruct's
#: card: ``generate(..., temperature=0.2, top_p=0.9, do_sample=True)``; its HF
#: generation_config.json carries only token ids), and fdx's own cap on a
#: request without ``max_tokens``: at temperature 0.2 the 135M model can still
#: fall into a loop ("la France, la France, ...") that would otherwise run to
#: the end of its 8,192-token context (minutes on a CPU)
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "smollm2": {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 512},
}

GENERATION_CONFIG_FILE = "generation_config.json"


def _number(lo: float, hi: float, lo_open: bool = False) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return "a finite number"
        if (v <= lo if lo_open else v < lo) or v > hi:
            if hi == math.inf:
                return f"a finite number >= {lo:g}"
            return f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        return None
    return check


def _integer(lo: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            return f"an integer >= {lo}"
        return None
    return check


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "temperature": _number(0.0, math.inf),
    "top_p": _number(0.0, 1.0, lo_open=True),
    "top_k": _integer(-1),
    "min_p": _number(0.0, 1.0),
    "repetition_penalty": _number(0.0, 10.0, lo_open=True),
    "max_new_tokens": _integer(1),
}


@attrs.frozen(kw_only=True)
class GenerationDefaults:
    """Sampling defaults of the served model (``None``: the API's own)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    #: cap on ``max_tokens`` of a request without one (generation_config's ``max_new_tokens``)
    max_tokens: int | None = None
    #: where they came from, e.g. ``"fdx's defaults for smollm2"``
    source: str = "none"
    #: keys of the generation_config.json that are not sampling defaults
    ignored: tuple[str, ...] = ()

    def values(self) -> dict[str, Any]:
        """The defaults in force, OpenAI field names (``max_tokens``)."""
        return {f: getattr(self, f) for f in SAMPLING_KEYS.values() if getattr(self, f) is not None}

    def describe(self) -> str:
        vals = self.values()
        shown = ", ".join(f"{k}={v}" for k, v in vals.items()) or "none (the OpenAI defaults)"
        return f"{shown} (from {self.source})"


def parse_override(raw: str | dict[str, Any] | None) -> dict[str, Any]:
    """``--override-generation-config`` as a checked dict: a JSON object of
    :data:`SAMPLING_KEYS` with valid values, else a one-line ConfigError."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--override-generation-config is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
    unknown = sorted(k for k in raw if k not in SAMPLING_KEYS)
    if unknown:
        raise ConfigError(f"--override-generation-config: fdx does not implement {', '.join(unknown)}; "
                          f"supported keys: {', '.join(SAMPLING_KEYS)}")
    _check(raw, "--override-generation-config")
    return dict(raw)


def _check(values: dict[str, Any], where: str) -> None:
    for key, v in values.items():
        want = _CHECKS[key](v)
        if want is not None:
            raise ConfigError(f"{where}: {key} must be {want}, got {v!r}")


def check_mode(value: str) -> None:
    """``--generation-config``: ``auto``, ``vllm`` or an existing path."""
    if value in ("auto", "vllm"):
        return
    if not os.path.exists(_config_file(value)):
        raise ConfigError(f"--generation-config {value!r}: expected auto, vllm, or a {GENERATION_CONFIG_FILE} "
                          "file or a folder holding one")


def _config_file(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    return os.path.join(path, GENERATION_CONFIG_FILE) if os.path.isdir(path) else path


def read_generation_config(path: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A generation_config.json's sampling defaults (checked) and the keys
    it has that are not sampling defaults."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--generation-config: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--generation-config: {path} is not a JSON object")
    found = {k: v for k, v in data.items() if k in SAMPLING_KEYS and v is not None}
    _check(found, path)
    return found, tuple(sorted(k for k in data if k not in SAMPLING_KEYS))


def load_generation_defaults(mode: str, model: str | None, override: dict[str, Any] | None = None,
                             ) -> GenerationDefaults:
    """The defaults for ``--generation-config mode`` on ``--model model``."""
    values: dict[str, Any] = {}
    ignored: tuple[str, ...] = ()
    source = "none"
    if mode == "auto":
        from fdx.model.source import resolve

        src = resolve(model)
        own = os.path.join(src.path, GENERATION_CONFIG_FILE) if src.kind == "hf" else None
        if own is not None and os.path.isfile(own):
            values, ignored = read_generation_config(own)
            source = own
        elif src.kind == "gguf" and src.name in KNOWN_MODELS:
            values = dict(KNOWN_MODELS[src.name])
            source = f"fdx's defaults for {src.name}"
    elif mode != "vllm":
        path = _config_file(mode)
        values, ignored = read_generation_config(path)
        source = path
    if override:
        values.update(override)
        source = f"{source} + --override-generation-config" if source != "none" else "--override-generation-config"
    return GenerationDefaults(**{SAMPLING_KEYS[k]: v for k, v in values.items()}, source=source, ignored=ignored)


__all__ = ["GenerationDefaults", "KNOWN_MODELS", "SAMPLING_KEYS", "check_mode", "load_generation_defaults",
           "parse_override", "read_generation_config"]
