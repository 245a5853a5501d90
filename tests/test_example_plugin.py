"""The third-party example package: pip-installed, selected by name through
the same path as ``fdx serve --scheduler NAME``, and visibly used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from serverutil import start_server

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fdx-plugin-example"

pytestmark = pytest.mark.slow


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, timeout=300)


@pytest.fixture(scope="module")
def example_installed() -> Iterator[None]:
    """pip-install the example distribution for this module, then remove it."""
    _pip("install", "--no-deps", str(EXAMPLE))
    try:
        yield
    finally:
        _pip("uninstall", "-y", "fdx-plugin-example")


def test_fdx_plugins_lists_the_example(example_installed: None) -> None:
    r = subprocess.run([sys.executable, "-m", "fdx", "plugins"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {tuple(ln.split()[:5]) for ln in r.stdout.splitlines()}
    assert ("scheduler", "serial", "example", "fdx-plugin-example", "0.1.0") in rows
    assert ("token_processor", "upper", "example", "fdx-plugin-example", "0.1.0") in rows


def test_cli_path_selects_the_example_components(example_installed: None) -> None:
    """`fdx serve`'s own parsing/validation path, in process, drives a real
    engine with the example scheduler and token processor."""
    from fdx.cli import build_parser, config_from_args
    from fdx.core.messages import SamplingParams
    from fdx.core.plugins import load_plugins, set_plugins

    plugins = load_plugins()
    args = build_parser(plugins).parse_args(["serve", "--scheduler", "serial", "--token-processor", "upper", "--num-kv-blocks", "64"])
    cfg = config_from_args(args, plugins)
    set_plugins(plugins)
    try:
        import fdx

        llm = fdx.LLM(model=cfg.model, scheduler=cfg.scheduler, token_processor=cfg.token_processor, num_kv_blocks=cfg.num_kv_blocks)
        assert type(llm.engine.scheduler).__name__ == "SerialScheduler"
        params = SamplingParams(temperature=0, max_tokens=12)
        results = llm.generate(["The capital of France is", "My favourite colour is", "Once upon a time"], params)
    finally:
        set_plugins(None)
    for res in results:
        plain = llm.tokenizer.decode(res.token_ids)
        assert any(c.isalpha() for c in plain)
        assert res.text == plain.upper() != plain
    # serial: the engine never ran more than one sequence per step
    assert llm.engine.scheduler.max_running_seen == 1


def test_fdx_serve_uses_the_example_components(example_installed: None) -> None:
    with start_server("--scheduler", "serial", "--token-processor", "upper", "--example-greeting", "bonjour") as (base, _proc):
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert any(c.isalpha() for c in text) and text == text.upper()
        # extension hooks ran in the API process: option, route, life-cycle events
        ev = httpx.get(base + "/example/events", timeout=10).json()
        assert ev == {"greeting": "bonjour", "added": 1, "first_token": 1, "finished": 1, "aborted": 0}
