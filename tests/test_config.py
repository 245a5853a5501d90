"""Config validation: bad values give one-line errors naming the flag."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest

from fdx.config import make_config, parse_bytes
from fdx.core.errors import ConfigError


def test_defaults_are_valid_and_frozen() -> None:
    cfg = make_config()
    assert cfg.scheduler == "v1" and cfg.device == "cpu" and cfg.port == 8000
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"max_num_seqs": 0}, "--max-num-seqs"),
        ({"port": 70000}, "--port"),
        ({"block_size": -4}, "--block-size"),
        ({"num_kv_blocks": 0}, "--num-kv-blocks"),
        ({"cache_backend_config": "{not json"}, "--cache-backend-config"),
        ({"cache_backend_config": "[1, 2]"}, "--cache-backend-config"),
        ({"kv_cache_memory": "lots"}, "--kv-cache-memory"),
        ({"max_num_batched_tokens": 8, "block_size": 16}, "--max-num-batched-tokens"),
    ],
)
def test_bad_values_name_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        make_config(**kwargs)


def test_parse_bytes() -> None:
    assert parse_bytes("2G", "--x") == 2 << 30
    assert parse_bytes("512MiB", "--x") == 512 << 20
    assert parse_bytes("1000", "--x") == 1000


def test_replace_revalidates() -> None:
    cfg = make_config()
    assert cfg.replace(max_num_seqs=3).max_num_seqs == 3
    with pytest.raises(ConfigError):
        cfg.replace(max_num_seqs=-1)


def test_cli_bad_flag_value_is_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "fdx", "serve", "--max-num-seqs", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["fdx: error: --max-num-seqs must be > 0, got 0"]


def test_kv_cache_dtype_is_checked_and_lists_the_choices() -> None:
    assert make_config().kv_cache_dtype == "auto"
    assert make_config(kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8: unknown; choose one of auto, float32, bfloat16"):
        make_config(kv_cache_dtype="fp8")
    r = subprocess.run([sys.executable, "-m", "fdx", "serve", "--kv-cache-dtype", "fp8"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "fdx: error: --kv-cache-dtype fp8: unknown; choose one of auto, float32, bfloat16"]


def test_cli_bad_model_is_one_line_before_any_process_starts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"garbage")
    for model, why in ((str(tmp_path / "missing.gguf"), "file not found"), (str(bad), "not a GGUF file")):
        r = subprocess.run([sys.executable, "-m", "fdx", "serve", "--model", model, "--port", "0"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"fdx: error: {model}: {why}"), r.stderr
