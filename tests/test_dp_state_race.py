"""A node's control calls and its heartbeat's applying of the cluster's
state (``P:state``) never undo each other, on a real ``redis-server``.

The race this pins: node B lags one revision (the last call came from
another node: its revision reaches B at B's next heartbeat).  B's heartbeat
reads that revision ("resumed") just as a pause arrives on B's ``ctl``
list.  Applied after the pause, the stale revision would resume B, and B's
own record of the pause would then mark it applied: B stayed out of the
load table, or refused the update_weights that needs it paused.

The replica set is a stand-in (the race is the client's own logic; the
real cluster's test is ``test_dp_redis_serve.py``): it keeps a paused flag
and answers each control call after a moment, as the engines' round trip
does."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kvservices import RedisServer, have_redis

from fdx.config import EngineConfig
from fdx.plugins.deployments.dp_global_queue import GlobalQueueClient

pytest.importorskip("redis")
pytestmark = [pytest.mark.redis,
              pytest.mark.skipif(not have_redis(), reason="redis-server not installed (apt-get install redis-server)")]


class Replicas:
    """This node's replicas as the client sees them: a paused flag, each call a round trip."""

    weights_version = None
    on_failure = on_ready = metrics = None

    def __init__(self) -> None:
        self._paused = False
        self.calls: list[str] = []

    def unavailable_reason(self) -> str | None:
        return None

    async def call(self, method: str, args: Any, timeout: float) -> dict[str, Any]:
        self.calls.append(method)
        if method == "is_paused":
            await asyncio.sleep(0.2)  # the state's read is slow: the pause lands inside it
            return {"is_paused": self._paused}
        await asyncio.sleep(0.02)
        if method in ("pause", "resume"):
            self._paused = method == "pause"
        return {"is_paused": self._paused}


@pytest.fixture(scope="module")
def redis_url() -> Any:
    with RedisServer() as rs:
        yield rs.url


@pytest.mark.parametrize("first", ["heartbeat", "control"])
def test_a_stale_revision_never_undoes_a_control_call(redis_url: str, first: str) -> None:
    async def scenario() -> tuple[Replicas, GlobalQueueClient, list[str]]:
        cfg = EngineConfig(scheduler="dp", dp_backend="redis", redis_url=redis_url, dp_cluster=f"race-{first}")
        reps = Replicas()
        q = GlobalQueueClient(cfg, reps)
        try:
            await q.r.set(q._k("state"), json.dumps({"paused": False, "rev": 5}))  # the last call: a resume
            q.state_rev, q._state_known = 4, True  # this node has not read it yet
            if first == "heartbeat":
                await q._sync_state()  # the heartbeat starts applying revision 5 ...
                await asyncio.sleep(0.05)
                await q._call_local("pause", {}, 5.0)  # ... and the pause from another node comes in
            else:
                pause = asyncio.ensure_future(q._call_local("pause", {}, 5.0))
                await asyncio.sleep(0)
                await q._sync_state()
                await pause
            await q._state_task
            before = list(reps.calls)
            # the pause's origin records it (revision 6); the next heartbeat finds nothing to do
            await q.r.set(q._k("state"), json.dumps({"paused": True, "rev": 6}))
            await q._sync_state()
            if q._state_task is not None:
                await q._state_task
            return reps, q, reps.calls[len(before):]
        finally:
            await q.r.aclose()
            await q.r_out.aclose()
            await q.r_wake.aclose()

    reps, q, later = asyncio.run(scenario())
    assert reps._paused, reps.calls  # the pause stands
    assert "resume" not in reps.calls, reps.calls  # the stale revision resumed nothing
    assert q.state_rev == 6 and q.state_error is None and q._serving_locally() is False
    assert later in ([], ["is_paused"]), later  # revision 6: already so
