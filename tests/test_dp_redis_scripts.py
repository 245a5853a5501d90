"""The dp global queue's Lua scripts (fdx/plugins/deployments/dp_global_queue.py) on a real
``redis-server``: placement on the least-loaded instance, the atomic pick
(own queue first, then stealing from the busiest), skipping aborted and
expired entries, reaping a dead instance, aborts routed to the owner, the
TTL expiry at the origin, and the leases: renewal, reclaim by the origin
once a lease ran out, the fenced push that drops a stale owner's outputs.
No fdx server: the scripts alone."""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest
from kvservices import RedisServer, have_redis

redis = pytest.importorskip("redis")

from fdx.plugins.deployments.dp_global_queue import (  # noqa: E402
    ABORT, ANY, ENQUEUE, EXPIRE, PICK, PUSH, RECLAIM, RECORD, RELEASE, RENEW)

pytestmark = [pytest.mark.redis,
              pytest.mark.skipif(not have_redis(), reason="redis-server not installed (apt-get install redis-server)")]
P = "fdx:t"


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture()
def r(server: RedisServer) -> Iterator[Any]:
    c = redis.Redis.from_url(server.url)
    c.flushall()
    yield c
    c.close()


class Scripts:
    def __init__(self, c: Any) -> None:
        self.c = c
        self.enqueue_ = c.register_script(ENQUEUE)
        self.pick_ = c.register_script(PICK)
        self.release_ = c.register_script(RELEASE)
        self.abort_ = c.register_script(ABORT)
        self.expire_ = c.register_script(EXPIRE)
        self.renew_ = c.register_script(RENEW)
        self.push_ = c.register_script(PUSH)
        self.reclaim_ = c.register_script(RECLAIM)
        self.leases: dict[str, tuple[str, str, str, str]] = {}  # key -> (key, fence, epoch, origin)

    def join(self, inst: str, load: int = 0, capacity: int = 4) -> None:
        self.c.set(f"{P}:instance:{inst}", "{}", px=60_000)
        self.c.hset(f"{P}:capacity", inst, capacity)
        self.c.zadd(f"{P}:instances", {inst: load})

    def enqueue(self, key: str, origin: str = "a", ttl_ms: int = 60_000, hashes: tuple[str, ...] = (),
                slack: float = 1.0) -> Any:
        out = self.enqueue_(args=[P, key, origin, b"blob-" + key.encode(), ttl_ms, slack, *hashes])
        return out.decode() if isinstance(out, bytes) else out

    def pick(self, me: str, n: int = 8, steal_after_ms: int = 0,
             lease_ms: int = 60_000) -> list[tuple[str, str, bytes]]:
        rows = self.pick_(args=[P, me, n, 3_600_000, steal_after_ms, lease_ms])
        epoch = rows[0].decode()
        got = [(rows[i].decode(), rows[i + 1].decode(), rows[i + 2]) for i in range(1, len(rows), 4)]
        for i in range(1, len(rows), 4):
            self.leases[rows[i].decode()] = (rows[i].decode(), str(rows[i + 3]), epoch, rows[i + 1].decode())
        return got

    def renew(self, me: str, *keys: str, lease_ms: int = 60_000) -> list[str]:
        lost = self.renew_(args=[P, me, lease_ms, 3_600_000, *(x for k in keys for x in self.leases[k])])
        return [k.decode() for k in lost]

    def push(self, me: str, origin: str, keys: tuple[str, ...], *entries: bytes) -> list[str]:
        stale = self.push_(args=[P, me, f"{P}:out:{origin}", 60_000, len(keys),
                                 *(x for k in keys for x in self.leases[k]), *entries])
        return [k.decode() for k in stale]

    def reclaim(self, *keys: str) -> list[tuple[str, str]]:
        rows = self.reclaim_(args=[P, *keys])
        return [(rows[i].decode(), rows[i + 1].decode()) for i in range(0, len(rows), 2)]

    def queue(self, inst: str) -> list[str]:
        return [k.decode() for k in self.c.lrange(f"{P}:queue:{inst}", 0, -1)]


def test_enqueue_goes_to_the_least_loaded_instance_and_ties_to_the_origin(r: Any) -> None:
    s = Scripts(r)
    s.join("a", load=2)
    s.join("b", load=0)
    s.join("c", load=0, capacity=0)  # a front end: never a target
    assert s.enqueue("r1", origin="a") == "b"  # b: 0/4 < a: 2/4
    assert s.enqueue("r2", origin="a") == "b"  # b: (0+1)/4 < a: 2/4
    assert s.enqueue("r3", origin="a") == "a"  # tie 2/4: the origin
    assert s.enqueue("r3", origin="a") is None  # the key exists: a duplicate id
    assert s.queue("b") == ["r1", "r2"] and s.queue("a") == ["r3"] and s.queue("c") == []
    h = r.hgetall(f"{P}:req:r1")
    assert h[b"origin"] == b"a" and h[b"add"] == b"blob-r1" and b"owner" not in h
    assert 0 < r.pttl(f"{P}:req:r1") <= 120_000
    assert r.llen(f"{P}:wake:b") >= 1  # the target is woken


def test_enqueue_with_no_instance_goes_to_any(r: Any) -> None:
    s = Scripts(r)
    s.join("a", capacity=0)
    assert s.enqueue("r1") == ANY and s.queue(ANY) == ["r1"]


def test_pick_takes_own_queue_first_then_steals_from_the_busiest(r: Any) -> None:
    s = Scripts(r)
    for inst in ("a", "b", "c"):
        s.join(inst)
    for k in ("a1", "a2"):
        r.hset(f"{P}:req:{k}", mapping={"add": k, "origin": "a", "deadline": 1 << 50})
        r.rpush(f"{P}:queue:a", k)
    for k in ("b1", "b2", "b3", "b4"):
        r.hset(f"{P}:req:{k}", mapping={"add": k, "origin": "x", "deadline": 1 << 50})
        r.rpush(f"{P}:queue:b", k)
    assert [k for k, _, _ in s.pick("a", 1)] == ["a1"]
    assert [k for k, _, _ in s.pick("a")] == ["a2"]  # own queue only, while it has some
    # c has none: steals from b (the longest), at most half of it, oldest first
    got = s.pick("c")
    assert [(k, o, b) for k, o, b in got] == [("b1", "x", b"b1"), ("b2", "x", b"b2")]
    assert s.queue("b") == ["b3", "b4"]
    for k in ("a1", "a2", "b1", "b2"):  # each taken once, owner recorded, in the taker's processing set
        owner = r.hget(f"{P}:req:{k}", "owner").decode()
        assert r.sismember(f"{P}:processing:{owner}", k)
    assert r.hget(f"{P}:req:b1", "owner") == b"c" and r.hget(f"{P}:req:a1", "owner") == b"a"
    assert [k for k, _, _ in s.pick("a")] == ["b3"]  # a's own queue is empty now: it steals too


def test_pick_skips_aborted_and_drops_expired_entries(r: Any) -> None:
    s = Scripts(r)
    s.join("a")
    s.enqueue("gone")
    s.enqueue("old", ttl_ms=1)
    s.enqueue("ok")
    r.delete(f"{P}:req:gone")  # aborted by its origin
    time.sleep(0.01)
    assert [k for k, _, _ in s.pick("a")] == ["ok"]
    assert not r.exists(f"{P}:req:old") and s.queue("a") == []


def test_release_reaps_a_dead_instance_and_its_queue_is_stolen(r: Any) -> None:
    s = Scripts(r)
    s.join("a")
    s.join("dead")
    r.hset(f"{P}:req:q1", mapping={"add": "q1", "origin": "a", "deadline": 1 << 50})
    r.rpush(f"{P}:queue:dead", "q1")
    r.sadd(f"{P}:processing:dead", "p1")
    assert s.release_(args=[P, "", "0"]) == 0  # its key is still there: alive
    r.delete(f"{P}:instance:dead")  # heartbeat key expired
    assert s.release_(args=[P, "", "0"]) == 1
    assert r.zscore(f"{P}:instances", "dead") is None and not r.exists(f"{P}:processing:dead")
    assert s.queue(ANY) == ["q1"]
    assert [k for k, _, _ in s.pick("a")] == ["q1"]
    # forced (a paused instance): out of the ZSET, its queue to _any, its processing set kept
    r.rpush(f"{P}:queue:a", "zz")
    r.sadd(f"{P}:processing:a", "q1")
    assert s.release_(args=[P, "a", "1"]) == 1
    assert r.zscore(f"{P}:instances", "a") is None and s.queue(ANY) == ["zz"]
    assert r.sismember(f"{P}:processing:a", "q1")


def test_abort_reaches_the_owner_and_expire_keeps_a_taken_request(r: Any) -> None:
    s = Scripts(r)
    s.join("a")
    s.enqueue("q")
    assert s.abort_(args=[P, "q", b"abort-q", ""]) is None  # not taken: just deleted
    assert not r.exists(f"{P}:req:q") and s.pick("a") == []
    s.enqueue("t")
    assert s.pick("a")[0][0] == "t"
    assert s.expire_(args=[P, "t"]) == b"a"  # taken meanwhile: it runs, not expired
    assert s.abort_(args=[P, "t", b"abort-t", ""]) == b"a"
    assert r.lrange(f"{P}:ctl:a", 0, -1) == [b"abort-t"] and not r.exists(f"{P}:req:t")
    s.enqueue("u")
    assert s.expire_(args=[P, "u"]) is None and not r.exists(f"{P}:req:u")


def test_enqueue_keeps_a_prompt_prefix_on_its_instance_unless_much_busier(r: Any) -> None:
    s = Scripts(r)
    s.join("a", load=0)
    s.join("b", load=0)
    first = s.enqueue("g1", origin="a", hashes=("h1", "h2"))
    other = "b" if first == "a" else "a"
    # the same prefix, longer: the same instance, though the other is less loaded now
    assert s.enqueue("g2", origin=other, hashes=("h1", "h2", "h3")) == first
    assert r.get(f"{P}:prefix:h3") == first.encode() and 0 < r.pttl(f"{P}:prefix:h1") <= 600_000
    assert s.enqueue("x1", origin=first, hashes=("z1",)) == other  # a new prefix: the least loaded
    # much busier (more than slack capacities above the least load): the least loaded wins, and is recorded
    r.zadd(f"{P}:instances", {first: 40})
    assert s.enqueue("g3", origin=first, hashes=("h1", "h2")) == other
    assert r.get(f"{P}:prefix:h2") == other.encode()
    # its instance gone: the prefix goes by load
    r.delete(f"{P}:instance:{other}")
    assert s.enqueue("g4", origin=other, hashes=("h1", "h2")) == first


def test_fresh_entries_are_left_to_their_instance_then_stolen(r: Any) -> None:
    s = Scripts(r)
    s.join("b")
    s.join("c")
    r.zadd(f"{P}:instances", {"c": 100})  # so that enqueue picks b
    assert s.enqueue("f1") == "b"
    assert s.pick("c", steal_after_ms=300) == [] and s.queue("b") == ["f1"]  # too fresh: b takes it
    time.sleep(0.35)
    assert [k for k, _, _ in s.pick("c", steal_after_ms=300)] == ["f1"]


def test_a_lease_is_renewed_then_reclaimed_once_and_its_stale_owner_is_fenced_off(r: Any) -> None:
    s = Scripts(r)
    s.join("b")
    s.enqueue("l1", origin="a")
    s.enqueue("l2", origin="a")
    assert [k for k, _, _ in s.pick("b", lease_ms=150)] == ["l1", "l2"]
    f1, f2 = int(s.leases["l1"][1]), int(s.leases["l2"][1])
    assert f2 > f1 > 0  # one cluster-wide counter: every new lease's token is greater
    assert s.reclaim("l1", "l2", "nope") == [("held", "b"), ("held", "b"), ("missing", "")]
    assert s.renew("b", "l1", "l2", lease_ms=150) == []
    assert s.push("b", "a", ("l1", "l2"), b"e1", b"e2") == [] and r.lrange(f"{P}:out:a", 0, -1) == [b"e1", b"e2"]
    assert s.renew("b", "l1", lease_ms=60_000) == []  # b renews l1 only: l2's lease runs out
    time.sleep(0.2)
    assert s.reclaim("l1", "l2") == [("held", "b"), ("reclaimed", "b")]
    assert s.reclaim("l2") == [("missing", "")]  # reclaimed once: the origin queues it again, once
    # the stale owner wakes up: its renewal reports the lost lease, its push of l2's outputs pushes nothing
    assert s.renew("b", "l1", "l2") == ["l2"]
    assert s.push("b", "a", ("l1", "l2"), b"late") == ["l2"] and r.llen(f"{P}:out:a") == 2
    # another owner's fence: the old one is refused even when the key is the same
    r.hset(f"{P}:req:l1", mapping={"owner": "c", "fence": "999"})
    assert s.renew("b", "l1") == ["l1"]
    s.enqueue("q1", origin="a")
    assert s.reclaim("q1") == [("queued", "")]


def test_a_lease_survives_a_redis_that_lost_its_data(r: Any) -> None:
    s = Scripts(r)
    s.join("b")
    s.enqueue("k1", origin="a")
    assert [k for k, _, _ in s.pick("b")] == ["k1"]
    r.delete(f"{P}:req:k1")  # deleted in the same data incarnation (the origin ended it): lost
    assert s.renew("b", "k1") == ["k1"]
    s.enqueue("k2", origin="a")
    assert [k for k, _, _ in s.pick("b")] == ["k2"]
    r.flushall()  # Redis restarted empty: the owner says it holds k2 again
    assert s.renew("b", "k2") == []
    h = r.hgetall(f"{P}:req:k2")
    assert h[b"owner"] == b"b" and h[b"origin"] == b"a" and h[b"fence"] == s.leases["k2"][1].encode()
    assert s.reclaim("k2") == [("held", "b")]
    assert s.push("b", "a", ("k2",), b"out") == [] and r.lrange(f"{P}:out:a", 0, -1) == [b"out"]


def test_the_cluster_state_merges_fields_and_its_revision_only_grows(r: Any) -> None:
    import json

    record = r.register_script(RECORD)

    def state() -> dict[str, Any]:
        return json.loads(r.get(P + ":state"))

    assert record(args=[P, 0, json.dumps({"paused": True})]) == 1
    assert record(args=[P, 1, json.dumps({"weights": {"path": "/w", "version": "v2"}})]) == 2
    assert state() == {"paused": True, "weights": {"path": "/w", "version": "v2"}, "rev": 2}
    assert record(args=[P, 0, json.dumps({"paused": False})]) == 3  # a caller that is behind: still newer
    assert state()["paused"] is False and state()["weights"]["version"] == "v2"
    r.flushall()  # Redis lost its data: the next revision is above what the caller had applied
    assert record(args=[P, 3, json.dumps({"paused": True})]) == 4
    assert state() == {"paused": True, "rev": 4}
