"""The deployment plugin kind: the built-ins register like plugins, an
unknown name lists the choices, and a third party's deployment (tests/
round_robin_deployment.py: two engines, round robin) serves the parity
prompts through a real ``fdx serve --deployment round_robin``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import round_robin_deployment
from serverutil import pid_alive, serve_command, start_server

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")


def greedy(base: str) -> list[Any]:
    out = []
    for p in PROMPTS:
        r = httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0,
                                                       "logprobs": 1}, timeout=300)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        out.append((c["text"], c["logprobs"]["token_logprobs"]))
    return out


def test_builtin_deployments_register_through_the_hook() -> None:
    from fdx.core.plugins import get_plugins

    names = set(get_plugins().registries["deployment"].names())
    assert {"single", "dp", "splitwise", "dp+splitwise"} <= names


def test_an_unknown_deployment_lists_the_choices() -> None:
    r = subprocess.run(serve_command("--deployment", "nope", "--port", "1"), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    line = r.stderr.strip().splitlines()[-1]
    assert "nope" in line and all(n in line for n in ("single", "dp", "splitwise", "dp+splitwise")), \
        r.stderr[-1500:]


def test_dp_splitwise_lays_out_prefill_and_decode_ranks() -> None:
    from fdx.config import make_config
    from fdx.core.plugins import get_plugins
    from fdx.deploy.deployment import create_deployment
    from fdx.router.topology import topology_children

    cfg = make_config(deployment="dp+splitwise", data_parallel_size=2, port=18000, num_threads=1)
    assert cfg.scheduler == "splitwise"  # implied
    dep = create_deployment(cfg, get_plugins())
    assert (dep.config.num_prefill, dep.config.num_decode) == (2, 2)
    kids = topology_children(dep.config)
    assert [k.name for k in kids] == ["prefill0", "prefill1", "decode0", "decode1", "router"]
    inst = [json.loads(k.config_json) for k in kids[:4]]
    assert [(c["splitwise_role"], c["dp_rank"]) for c in inst] == [("prefill", 0), ("prefill", 1), ("decode", 0),
                                                                   ("decode", 1)]
    # each instance is a single deployment of one engine (no recursion into dp+splitwise)
    assert all(c["deployment"] is None and c["data_parallel_size"] == 1 and c["num_prefill"] == c["num_decode"] == 0
               for c in inst)
    router = json.loads(kids[4].config_json)
    assert router["prefill"] == [k.url for k in kids[:2]] and router["decode"] == [k.url for k in kids[2:4]]
    # the splitwise flags set the counts apart
    dep = create_deployment(make_config(deployment="dp+splitwise", data_parallel_size=2, num_decode=3), get_plugins())
    assert (dep.config.num_prefill, dep.config.num_decode) == (2, 3)
    # an explicit --deployment splitwise runs its instances as single deployments too
    kids = topology_children(make_config(deployment="splitwise", scheduler="splitwise", num_prefill=1, num_decode=1))
    assert all(json.loads(k.config_json)["deployment"] is None for k in kids[:2])


@pytest.mark.parametrize("flags,words", [
    (("--deployment", "dp+splitwise", "--scheduler", "v1"), ("--scheduler splitwise", "--deployment dp")),
    (("--deployment", "dp+splitwise", "--splitwise-role", "decode"), ("--splitwise-role", "--deployment single")),
    (("--deployment", "dp+splitwise", "--dp-backend", "redis", "--redis-url", "redis://127.0.0.1:1"), ("local",)),
    (("--scheduler", "splitwise", "--num-prefill", "1", "--num-decode", "1", "--data-parallel-size", "2"),
     ("--scheduler dp", "--deployment dp+splitwise")),
])
def test_a_bad_dp_splitwise_combination_is_one_line(flags: tuple[str, ...], words: tuple[str, ...]) -> None:
    r = subprocess.run(serve_command(*flags, "--port", "1"), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr[-1500:]


def test_a_third_party_deployment_serves_the_parity_prompts(tmp_path: Path) -> None:
    with start_server("--max-num-seqs", "4") as (base, _):
        want = greedy(base)
    env = {"PYTHONPATH": round_robin_deployment.write_entry_point(str(tmp_path))}
    with start_server("--max-num-seqs", "4", "--deployment", "round_robin", env=env) as (base, _):
        got = greedy(base) + greedy(base)  # six requests: three on each engine
        engines = httpx.get(base + "/health").json()["engines"]
        counts = httpx.get(base + "/round_robin/replicas").json()
    assert [g[0] for g in got] == [w[0] for w in want] * 2
    for (_, a), (_, b) in zip(got, want * 2):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert [e["name"] for e in engines] == ["numa node 0", "numa node 1"]
    assert all(e["state"] == "serving" for e in engines) and len({e["pid"] for e in engines}) == 2
    assert counts["pids"] == [e["pid"] for e in engines] and all(n >= 3 * 16 for n in counts["generated"]), counts
    assert not any(pid_alive(p) for p in counts["pids"])  # stopped with the server
