"""State that survives a restart in ``fdx serve --scheduler splitwise`` (issue 26),
with real processes: the router, a prefill and a decode instance.

The router keeps the deployment's control state (fdx/router/state.py) from
the control calls that succeeded everywhere, and gives it to an instance
the topology started again before routing to it:

* pause and update_weights (version ``v2``) through the router, SIGKILL the
  decode instance's processes: once it is back (a new engine pid) its own
  ``/v1/is_paused`` says paused, its ``/health`` and ``/v1/models`` name
  ``v2``, a request through the router is not served until a resume, and
  the router's ``fdx:router_instance_restarts_total`` counted the restart;
* a state it cannot be given (the checkpoint of the last update_weights is
  gone) keeps the restarted prefill instance out of rotation, the reason in
  the router's ``/health``; an update_weights through the router to a
  checkpoint that exists is then given to it and it comes back;
* asleep (kv_cache) survives a SIGKILL of the router (its ``--state-file``)
  and then of the decode instance, which comes back asleep on the last
  weights, not served until a wakeup.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterator

import httpx
import pytest
from serverutil import metric_value, pid_alive, start_server
from test_splitwise_serve import COMMON, _kill_instance, _prompts, _wait

pytestmark = pytest.mark.slow

BODY = {"model": "smollm2", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from fdx.model.source import embedded_gguf_path

    gguf = embedded_gguf_path()
    allowed = tmp_path_factory.mktemp("weights")
    with start_server("--scheduler", "splitwise", "--num-prefill", "1", "--num-decode", "1",
                      "--splitwise-handoff-timeout", "600", "--allowed-weights-dir", str(allowed),
                      "--allowed-weights-dir", os.path.dirname(gguf), *COMMON, timeout=300) as (base, proc):
        _wait(lambda: _all_up(base), 300, f"not every instance came up: {_health(base)}")
        yield {"router": base, "proc": proc, "gguf": gguf, "allowed": allowed}


def _health(router: str) -> dict[str, Any]:
    return httpx.get(router + "/health", timeout=10).json()


def _all_up(router: str) -> bool:
    h = _health(router)
    return all(i["up"] for i in h["prefill"] + h["decode"])


def _inst(router: str, role: str) -> dict[str, Any]:
    return _health(router)[role][0]


def _ok(router: str, route: str, **kw: Any) -> dict[str, Any]:
    r = httpx.post(router + route, timeout=600, **kw)
    assert r.status_code == 200, r.text
    return r.json()["result"]


def _generate(router: str, seed: int) -> httpx.Response:
    return httpx.post(router + "/v1/completions", json={**BODY, "prompt": _prompts(1, seed=seed, hi=64)[0]},
                      timeout=300)


def _restarted(router: str, role: str, old_pid: int) -> dict[str, Any] | None:
    inst = _inst(router, role)
    return inst if inst.get("engine_pid") not in (None, old_pid) else None


def test_paused_and_weights_version_survive_an_instance_restart(pd: dict[str, Any]) -> None:
    router = pd["router"]
    d = _inst(router, "decode")
    url, old_pid = d["url"], d["engine_pid"]
    assert _health(router)["control_state"] in (None, {"is_paused": False, "sleeping": [], "weights": None})
    _ok(router, "/v1/pause")
    res = _ok(router, "/v1/update_weights", json={"path": pd["gguf"], "version": "v2"})
    assert res["version"] == "v2", res
    assert _health(router)["control_state"] == {"is_paused": True, "sleeping": [],
                                               "weights": {"path": pd["gguf"], "version": "v2"}}
    restarts = metric_value(router, "fdx:router_instance_restarts_total", instance=url)
    killed = _kill_instance(url)
    t_kill = time.monotonic()
    _wait(lambda: not any(pid_alive(p) for p in killed), 30, "the killed processes live on")
    _wait(lambda: _restarted(router, "decode", old_pid) is not None and _inst(router, "decode")["up"], 300,
          f"the decode instance did not come back: {_health(router)['decode']}")
    print(f"\ndecode instance back in rotation {time.monotonic() - t_kill:.1f}s after its SIGKILL "
          f"(engine pid {old_pid} -> {_inst(router, 'decode')['engine_pid']})")
    # the instance itself says so: paused, on v2
    own = httpx.get(url + "/v1/is_paused", timeout=30).json()["result"]
    assert own == {"is_paused": True, "sleeping": []}, own
    assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["version"] == "v2"
    _wait(lambda: httpx.get(url + "/health", timeout=10).json().get("weights_version") == "v2", 30,
          "the instance's /health does not name v2")
    assert metric_value(router, "fdx:router_instance_restarts_total", instance=url) == restarts + 1
    assert _inst(router, "decode")["restarts"] >= 1
    # not served until a resume through the router
    r = _generate(router, 401)
    assert r.status_code == 503, r.text
    assert _ok(router, "/v1/resume")["is_paused"] is False
    r = _generate(router, 402)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert _health(router)["control_state"]["is_paused"] is False


def test_a_state_it_cannot_be_given_keeps_the_instance_out(pd: dict[str, Any]) -> None:
    router, allowed = pd["router"], pd["allowed"]
    link = allowed / "gone.gguf"  # a checkpoint that disappears after the update
    link.symlink_to(pd["gguf"])
    p = _inst(router, "prefill")
    url, old_pid = p["url"], p["engine_pid"]
    _ok(router, "/v1/pause")
    assert _ok(router, "/v1/update_weights", json={"path": "gone.gguf", "version": "v3"})["version"] == "v3"
    link.unlink()
    _kill_instance(url)
    t_kill = time.monotonic()

    def refused() -> bool:
        inst = _restarted(router, "prefill", old_pid)
        return inst is not None and not inst["up"] and "update_weights" in (inst.get("control_state_error") or "")

    _wait(refused, 300, f"the prefill instance was not kept out: {_health(router)['prefill']}")
    h = httpx.get(router + "/health", timeout=10)
    assert h.status_code == 503, h.text
    inst = h.json()["prefill"][0]
    assert inst["reason"] == inst["control_state_error"] and "v3" in inst["reason"], inst
    print(f"\nprefill instance kept out {time.monotonic() - t_kill:.1f}s after its SIGKILL: {inst['reason']}")
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # the instance itself serves
    # a new checkpoint through the router: D takes it now, P when it is tried again
    res = _ok(router, "/v1/update_weights", json={"path": pd["gguf"], "version": "v4"})
    assert res["version"] == "v4" and [u["name"] for u in res["unavailable"]] == ["prefill0"], res
    _wait(lambda: _inst(router, "prefill")["up"], 120, f"prefill did not come back: {_health(router)['prefill']}")
    assert "control_state_error" not in _inst(router, "prefill")
    assert httpx.get(url + "/v1/is_paused", timeout=30).json()["result"]["is_paused"] is True
    assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["version"] == "v4"
    _ok(router, "/v1/resume")
    r = _generate(router, 403)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_asleep_survives_a_router_restart_then_an_instance_restart(pd: dict[str, Any]) -> None:
    router = pd["router"]
    _wait(lambda: _all_up(router), 120, f"not every instance is up: {_health(router)}")
    assert _ok(router, "/v1/sleep", params={"tags": "kv_cache"})["sleeping"] == ["kv_cache"]
    want = {**_health(router)["control_state"], "is_paused": True, "sleeping": ["kv_cache"]}
    # the router dies and the topology starts it again: it reads its --state-file back
    old_router = _health(router)["router_pid"]
    os.kill(old_router, signal.SIGKILL)
    t_kill = time.monotonic()
    _wait(lambda: _router_pid(router) not in (None, old_router), 120, "the router did not come back")
    print(f"\nrouter back {time.monotonic() - t_kill:.1f}s after its SIGKILL, control state {want}")
    assert _health(router)["control_state"] == want
    # then the decode instance dies: it comes back asleep (and on the weights of the last update_weights)
    d = _inst(router, "decode")
    url, old_pid = d["url"], d["engine_pid"]
    _kill_instance(url)
    _wait(lambda: _restarted(router, "decode", old_pid) is not None and _inst(router, "decode")["up"], 300,
          f"the decode instance did not come back: {_health(router)['decode']}")
    own = httpx.get(url + "/v1/is_paused", timeout=30).json()["result"]
    assert own == {"is_paused": True, "sleeping": ["kv_cache"]}, own
    assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["version"] == want["weights"]["version"]
    assert _generate(router, 404).status_code == 503
    assert _ok(router, "/v1/wakeup", params={"tags": "kv_cache"})["sleeping"] == []
    r = _generate(router, 405)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def _router_pid(router: str) -> int | None:
    try:
        r = httpx.get(router + "/health", timeout=5)
    except httpx.HTTPError:
        return None
    return r.json().get("router_pid") if r.status_code == 200 else None
