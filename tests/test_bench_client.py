"""``fdx bench serve`` end to end against a tiny in-process OpenAI-compatible
stub (isolates the client: SSE parsing, usage vs chunk counting, token-id
probe, failures, sweep, JSON and plot output).  The real-server test is in
tests/test_bench_serve.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any, Iterator

import pytest
from aiohttp import web

from fdx.bench import serve


class Stub:
    """Streams ``max_tokens`` one-word chunks; ``usage`` only when asked and
    ``self.usage`` is on; rejects prompts containing 'FAIL' with HTTP 400."""

    def __init__(self, usage: bool = True, accept_ids: bool = True) -> None:
        self.usage = usage
        self.accept_ids = accept_ids
        self.bodies: list[dict[str, Any]] = []

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = request.path.endswith("/chat/completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and not self.accept_ids:
            return web.json_response({"error": {"message": "prompt must be a string", "code": 400}}, status=400)
        text = json.dumps(body.get("messages")) if chat else (prompt if isinstance(prompt, str) else "")
        if "FAIL" in text:
            return web.json_response({"error": {"message": "bad prompt", "type": "invalid_request_error"}}, status=400)
        n_prompt = len(prompt) if isinstance(prompt, list) else len(text.split())
        n = int(body.get("max_tokens", 4))
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x", "index": 0}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(0.002)
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": f" w{i}"}
            else:
                choice["text"] = f" w{i}"
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        fin: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        fin["delta" if chat else "text"] = {} if chat else ""
        await resp.write(f"data: {json.dumps({'choices': [fin]})}\n\n".encode())
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(stub: Stub) -> Iterator[str]:
    port = _free_port()
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/v1/models", stub.models)
    app.router.add_post("/v1/completions", stub.complete)
    app.router.add_post("/v1/chat/completions", stub.complete)
    runner = web.AppRunner(app)
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


@pytest.fixture()
def stub() -> Stub:
    return Stub()


@pytest.fixture()
def url(stub: Stub) -> Iterator[str]:
    yield from _serve(stub)


COMMON = ["--no-progress", "--no-idle-check", "--warmup", "1", "--seed", "1"]


def _run(argv: list[str], tmp_path: Any) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "r.json"
    rc = serve.main([*argv, *COMMON, "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_random_ids_usage_and_exact_counts(url: str, stub: Stub, tmp_path: Any) -> None:
    rc, doc = _run(
        ["--base-url", url, "--num-prompts", "6", "--random-input-len", "40", "--random-output-len", "7",
         "--max-concurrency", "3", "--ignore-eos", "--goodput", "ttft:10000"],
        tmp_path,
    )
    assert rc == 0
    assert doc["model"] == "stub-model" and doc["prompt_format"] == "ids"
    run = doc["runs"][0]
    assert run["completed"] == 6 and run["failed"] == 0
    assert run["total_output_tokens"] == 42 and run["total_input_tokens"] == 240
    assert run["usage_reported"] is True
    assert run["good_requests"] == 6
    timed = stub.bodies[-6:]
    assert all(b["ignore_eos"] is True and b["stream_options"] == {"include_usage": True} for b in timed)
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 40 for b in timed)
    assert len({tuple(b["prompt"]) for b in timed}) == 6  # nonce: no repeats
    assert all(r["chunks"] == 7 for r in run["per_request"])
    assert run["mean_itl_ms"] > 0 and run["mean_ttft_ms"] > 0


def test_text_prompts_chunk_counting_and_chat(tmp_path: Any) -> None:
    stub = Stub(usage=False, accept_ids=False)
    for url in _serve(stub):
        rc, doc = _run(["--base-url", url, "--num-prompts", "4", "--random-input-len", "30",
                        "--random-output-len", "5", "--max-concurrency", "2"], tmp_path)
        assert rc == 0 and doc["prompt_format"] == "text"
        run = doc["runs"][0]
        assert run["usage_reported"] is False and run["total_output_tokens"] == 20
        assert all(isinstance(b["prompt"], str) for b in stub.bodies[-4:])
        rc, doc = _run(["--base-url", url, "--endpoint", "/v1/chat/completions", "--dataset", "shared-prefix",
                        "--num-prompts", "4", "--shared-prefix-groups", "2", "--shared-prefix-len", "50",
                        "--shared-prefix-suffix-len", "5", "--random-output-len", "3"], tmp_path)
        assert rc == 0 and doc["runs"][0]["total_output_tokens"] == 12
        msgs = [b["messages"] for b in stub.bodies[-4:]]
        assert msgs[0][0]["role"] == "system" and msgs[0][0]["content"] == msgs[2][0]["content"]
        assert msgs[0][0]["content"] != msgs[1][0]["content"]


def test_failures_are_counted_and_exit_code_is_1(url: str, tmp_path: Any) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('"hello there"\n{"prompt": "please FAIL", "max_tokens": 2}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    rc, doc = _run(["--base-url", url, "--dataset", "jsonl", "--dataset-path", str(path), "--num-prompts", "3",
                    "--output-len", "4", "--warmup", "0"], tmp_path)
    assert rc == 1
    run = doc["runs"][0]
    assert run["completed"] == 2 and run["failed"] == 1
    assert run["errors"] == {"HTTP 400: bad prompt": 1}


def test_sweep_json_and_plot(url: str, tmp_path: Any) -> None:
    png = tmp_path / "p.png"
    rc, doc = _run(["--base-url", url, "--num-prompts", "4", "--random-input-len", "20", "--random-output-len", "3",
                    "--sweep-concurrency", "1,2,4", "--request-rate", "200", "--label", "stub", "--plot", str(png)],
                   tmp_path)
    assert rc == 0 and [r["max_concurrency"] for r in doc["runs"]] == [1, 2, 4]
    assert png.stat().st_size > 1000
    from fdx.bench.plot import main as plot_main

    png2 = tmp_path / "two.png"
    j = tmp_path / "r.json"
    assert plot_main([str(j), str(j), "-o", str(png2)]) == 0 and png2.stat().st_size > 1000


def test_bad_arguments_are_one_line_errors(url: str, capsys: Any) -> None:
    assert serve.main(["--base-url", url, "--sweep-concurrency", "1,x", *COMMON]) == 2
    assert "--sweep-concurrency" in capsys.readouterr().err
    assert serve.main(["--base-url", url, "--goodput", "ttft", *COMMON]) == 2
    assert "--goodput" in capsys.readouterr().err
    assert serve.main(["--base-url", "http://127.0.0.1:9", *COMMON]) == 2
    assert "cannot reach" in capsys.readouterr().err
