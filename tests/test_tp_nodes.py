"""Tensor parallelism across hosts (--nnodes, --node-rank, --master-addr,
--master-port; the gloo backend), on loopback: two "nodes" are two real
`fdx serve` processes on this machine.  Node 0 serves the API and runs rank 0,
node 1 runs a node agent that starts rank 1 for each of rank 0's groups."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from typing import Any, Iterator

import httpx
import pytest
from serverutil import free_port, pid_alive, serve_command, start_server, stop_process
from test_tensor_parallel import (  # noqa: F401 - random_llama: the fixture
    _ancestry, assert_same, completions, lose_a_rank_under_16_streams, random_llama)

ARGS = ("--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "256", "--max-num-seqs", "16")


def _nodes(port: int) -> tuple[str, ...]:
    return ("-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))


@pytest.fixture
def node1(random_llama: str) -> Iterator[Any]:  # noqa: F811
    """Node 1's `fdx serve --node-rank 1` (started first: node 0 waits for its rank to join)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="fdx-node1-", suffix=".log", delete=False)
    proc = subprocess.Popen(serve_command("--model", random_llama, *ARGS, *_nodes(port), "--node-rank", "1",
                                          "--step-timeout", "8"),
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.master_port = port  # type: ignore[attr-defined]
    proc.log_path = log.name  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        stop_process(proc)
        log.close()
        if not os.environ.get("FDX_KEEP_SERVER_LOGS"):
            with contextlib.suppress(OSError):
                os.unlink(log.name)


# SIGKILL: gloo's own error at rank 0 (~1 s); SIGSTOP: rank 0's watchdog (0.8 x --step-timeout)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_two_nodes_on_loopback_match_one_rank_and_recover_from_a_lost_remote_rank(
        random_llama: str, node1: Any, sig: int) -> None:  # noqa: F811
    with start_server("--model", random_llama, *ARGS, default_args=()) as (base, _):
        one = completions(base, 32)
    args = ("--model", random_llama, *ARGS, *_nodes(node1.master_port), "--node-rank", "0", "--step-timeout", "8")
    with start_server(*args, default_args=(), timeout=300) as (base, proc):
        assert_same(one, completions(base, 32))
        before = httpx.get(base + "/health").json()
        [remote] = before["rank_pids"]
        assert pid_alive(remote) and str(node1.pid) in _ancestry(remote)  # rank 1 is node 1's child
        text = httpx.get(base + "/metrics").text
        assert 'fdx:tensor_parallel_info{backend="gloo"' in text and 'size="2"' in text
        # node 1's rank killed or stopped under 16 streams: the step fails, clean 503s, the group restarts
        after = lose_a_rank_under_16_streams(base, remote, sig, random_llama, within=60)
        [again] = after["rank_pids"]
        assert str(node1.pid) in _ancestry(again)  # node 1's agent started the new rank
        assert_same(one, completions(base, 32))
        if sig == signal.SIGKILL:  # rank 0 (node 0's engine) killed: node 1's rank sees its connection drop
            engine = after["engine_pid"]
            os.kill(engine, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    h = httpx.get(base + "/health", timeout=5)
                    if h.status_code == 200 and h.json()["engine_pid"] != engine:
                        break
                assert time.monotonic() < deadline
                time.sleep(0.25)
            assert not pid_alive(again) and h.json()["rank_pids"][0] != again
            assert completions(base, 8)
    assert node1.poll() is None  # the agent outlives rank 0's groups


def test_gloo_on_one_host_matches_one_rank(random_llama: str) -> None:  # noqa: F811
    with start_server("--model", random_llama, *ARGS, default_args=()) as (base, _):
        one = completions(base, 16)
    with start_server("--model", random_llama, *ARGS, "-tp", "2", "--tp-backend", "gloo", default_args=(),
                      timeout=300) as (base, _):
        assert_same(one, completions(base, 16))
        assert 'fdx:tensor_parallel_info{backend="gloo"' in httpx.get(base + "/metrics").text


@pytest.mark.parametrize("flags,says", [
    (("-tp", "3", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "1"), "must be a multiple"),
    (("-tp", "2", "--nnodes", "2"), "needs --master-addr and --master-port"),
    (("-tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1"), "below --nnodes"),
    (("-tp", "2", "--nnodes", "2", "--tp-backend", "shm", "--master-addr", "h", "--master-port", "1"), "use gloo"),
])
def test_a_bad_node_flag_combination_is_a_one_line_error(flags: tuple[str, ...], says: str) -> None:
    r = subprocess.run(serve_command("--port", "1", *flags), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.strip().splitlines() if says in line]
    assert len(lines) == 1 and len(r.stderr.strip().splitlines()) <= 2, r.stderr[-2000:]

