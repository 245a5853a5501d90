"""The KV connector plugin kind: registry (a toy connector on a fresh
plugin manager serves requests through a real P/D handoff), names,
``fdx plugins``; the built-in ``zmq`` and ``mooncake`` connectors move
blocks byte-exactly (mooncake against a real ``mooncake_master``), release
what is not loaded, and report lost or unreachable peers; the splitwise wire
messages round-trip."""

from __future__ import annotations

import collections
import subprocess
import sys
import time
from typing import Any, Sequence

import numpy as np
import pytest

from fdx.config import make_config
from fdx.core.errors import ConfigError, PluginError
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import KVConnector
from fdx.core.messages import (AddRequest, EngineStats, KVTransferParams, RequestOutput, SamplingParams,
                               SplitwiseStats, TokenLogprob, decode, encode)
from fdx.testing import EchoRunner
from kvservices import MooncakeMaster, have_mooncake
from splitwiseutil import drive, echo_engine, finished, free_tcp_address, request, tokens

# ---------------------------------------------------------------------- messages


@pytest.mark.parametrize("msg", [
    AddRequest("r", (1, 2), SamplingParams(max_tokens=3), 1.5, KVTransferParams("tcp://127.0.0.1:1", "http://p")),
    AddRequest("r", (1, 2), SamplingParams(), 1.5, KVTransferParams("tcp://a:1", "", "tcp://b:2", (4, 5, 9), 2)),
    AddRequest("r", (1,), SamplingParams(), 0.0),
    RequestOutput("r", (7,), None, 30, 16, 1, (TokenLogprob(7, -0.5, ((7, -0.5), (3, -1.0))),)),
    EngineStats(kv_blocks_used=3, splitwise=SplitwiseStats("decode", "tcp://h:1", 4, 1, 4096, 0.25,
                                                           (0, 1, 4), 0)),
])
def test_splitwise_messages_round_trip(msg: Any) -> None:
    assert decode(encode(msg)) == msg


# ---------------------------------------------------------------------- plugin kind

#: address -> inbox of the toy connectors in this process
_BUS: dict[str, collections.deque] = {}


class ToyConnector(KVConnector):
    """In-process connector: messages and copied KV bytes through a dict of queues."""

    def __init__(self, config: Any, runner: Any) -> None:
        self.runner = runner
        self.address = f"toy://{id(self)}"
        _BUS[self.address] = collections.deque()

    def send(self, peer: str, msg: Any, block_ids: Sequence[int] = ()) -> int:
        if peer not in _BUS:
            raise ConnectionError(f"no toy peer {peer}")
        payloads = self.runner.read_kv_blocks(block_ids) if block_ids else []
        _BUS[peer].append((self.address, encode(msg), payloads or None))
        return sum(len(p) for p in payloads)

    def recv(self) -> list[tuple[str, Any, Any]]:
        box = _BUS[self.address]
        out = []
        while box:
            peer, raw, kv = box.popleft()
            out.append((peer, decode(raw), kv))
        return out

    def load(self, kv: Any, block_ids: Sequence[int]) -> int:
        if kv is None or not block_ids:
            return 0
        self.runner.write_kv_blocks(block_ids, kv)
        return sum(len(p) for p in kv)

    def lost_peers(self) -> list[str]:
        return []

    def close(self) -> None:
        _BUS.pop(self.address, None)


class ToyPlugin:
    @hookimpl
    def fdx_register_kv_connectors(self, register: Any) -> None:
        register("toy", ToyConnector, description="in-process test connector")


def test_toy_connector_serves_requests_through_a_real_handoff(plugin_manager) -> None:  # type: ignore[no-untyped-def]
    import fdx.plugins.schedulers.splitwise
    import fdx.plugins.schedulers.v1
    from fdx.core.plugins import collect

    toy = ToyPlugin()
    plugin_manager.register(fdx.plugins.schedulers.v1)
    plugin_manager.register(fdx.plugins.schedulers.splitwise)
    plugin_manager.register(toy)
    try:
        plugins = collect(plugin_manager)
        assert plugins.registry("kv_connector").names() == ["toy"]
        cfg = {"scheduler": "splitwise", "kv_connector": "toy"}
        p = echo_engine(plugins, splitwise_role="prefill", **cfg)
        d = echo_engine(plugins, splitwise_role="decode", **cfg)
        assert isinstance(d.connector, ToyConnector)
        prompts = {"a": [5, 6, 7, 8] * 9, "b": [9, 1]}
        for rid, ids in prompts.items():
            d.add_request(request(rid, ids, p, max_tokens=6))
        out = drive([p, d], finished(*prompts))
        for rid, ids in prompts.items():
            assert tokens(out[rid]) == (ids * 6)[:6]  # the echo runner repeats the prompt
        assert d.stats().splitwise.handoffs == 2 and d.kv.num_used_blocks == 0 == p.kv.num_used_blocks
        p.close()
        d.close()
    finally:
        plugin_manager.unregister(toy)
    assert "toy" not in collect(plugin_manager).registry("kv_connector").names()


def test_unknown_connector_lists_the_choices() -> None:
    from fdx.cli import build_parser, config_from_args
    from fdx.core.plugins import get_plugins

    plugins = get_plugins()
    args = build_parser(plugins).parse_args(["serve", "--scheduler", "splitwise", "--splitwise-role", "decode",
                                             "--kv-connector", "nope"])
    with pytest.raises(PluginError, match=r"unknown kv_connector 'nope'; choices: mooncake, zmq"):
        config_from_args(args, plugins)


def test_plugins_command_lists_the_connectors() -> None:
    out = subprocess.run([sys.executable, "-m", "fdx", "plugins"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    assert ["kv_connector", "zmq", "kv_connector_zmq", "fdx"] in [r[:4] for r in rows]
    assert ["kv_connector", "mooncake", "kv_connector_mooncake", "fdx"] in [r[:4] for r in rows]
    assert ["scheduler", "splitwise", "scheduler_splitwise", "fdx"] in [r[:4] for r in rows]


def test_connector_config_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match="unknown key.*bogus.*known: address"):
        echo_engine(scheduler="splitwise", splitwise_role="decode", kv_connector_config={"bogus": 1})
    with pytest.raises(ConfigError, match="connect_timeout must be > 0"):
        echo_engine(scheduler="splitwise", splitwise_role="decode", kv_connector_config={"connect_timeout": 0})
    with pytest.raises(ConfigError, match="not valid JSON"):
        make_config(scheduler="splitwise", splitwise_role="decode", kv_connector_config="{nope")


# ---------------------------------------------------------------------- the built-in connectors


@pytest.fixture(scope="module")
def master():  # type: ignore[no-untyped-def]
    if not have_mooncake():
        pytest.skip("mooncake_master / mooncake.store not installed (pip install 'fdx[mooncake]')")
    with MooncakeMaster() as m:
        yield m


def _pair(name: str, master: Any = None, **opts: Any) -> tuple[Any, Any]:
    from fdx.core.plugins import get_plugins

    extra = {"master": master.address, "global_segment_size": "32M"} if name == "mooncake" else {}
    made = []
    for _ in range(2):
        cfg = make_config(num_kv_blocks=32, scheduler="splitwise", splitwise_role="decode", kv_connector=name,
                          kv_connector_config={**extra, **opts})
        runner = EchoRunner(cfg)
        made.append(get_plugins().create("kv_connector", name, config=cfg, runner=runner))
    return made[0], made[1]


def _recv(conn: Any, n: int = 1, timeout: float = 10.0) -> list[tuple[str, Any, Any]]:
    got: list[tuple[str, Any, Any]] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"received {len(got)} of {n}"
        got += conn.recv()
        time.sleep(0.005)
    return got


@pytest.mark.parametrize("name", ["zmq", "mooncake", "zmq-ipc"])
def test_blocks_arrive_byte_exact_where_the_receiver_puts_them(name: str, request: Any, tmp_path: Any) -> None:
    if name == "zmq-ipc":  # any ZMQ endpoint works as an address
        a, b = _pair_one("zmq", address=f"ipc://{tmp_path}/a"), _pair_one("zmq", address=f"ipc://{tmp_path}/b")
        assert a.address == f"ipc://{tmp_path}/a"
    else:
        a, b = _pair(name, request.getfixturevalue("master") if name == "mooncake" else None)
    try:
        bs = a.runner.block_size
        rng = np.random.default_rng(0)
        a.runner.slots[:] = rng.integers(0, 1 << 40, a.runner.slots.size)
        msg = RequestOutput("r1", (42,), None, 3 * bs, 0, 1)
        sent = a.send(b.address, msg, [3, 5, 7])
        assert sent == 3 * bs * 8
        ((peer, got, kv),) = _recv(b)
        assert peer == a.address and got == msg and kv is not None
        assert b.load(kv, [10, 11, 12]) == sent
        for src, dst in ((3, 10), (5, 11), (7, 12)):
            assert (b.runner.slots[dst * bs:(dst + 1) * bs] == a.runner.slots[src * bs:(src + 1) * bs]).all()
        assert (b.runner.slots[13 * bs:] == -1).all()  # nothing else written
        # a KV that is not loaded is released (mooncake: its objects are removed)
        a.send(b.address, RequestOutput("r2", (1,), None), [1])
        ((_, _, kv2),) = _recv(b)
        b.load(kv2, ())
        if name == "mooncake":
            assert a.store.batch_is_exist(kv[0] + kv2[0]) == [0, 0, 0, 0]
        # a message without KV, and a reply the other way
        b.send(a.address, RequestOutput("r3", (), "error", error="x", error_code=400))
        ((peer, got, kv3),) = _recv(a)
        assert peer == b.address and got.error == "x" and kv3 is None
        assert b.stats()["bytes_received"] == sent
    finally:
        a.close()
        b.close()


def _send_and_check(a: Any, b: Any, rid: str, src: list[int], dst: list[int]) -> None:
    bs = a.runner.block_size
    sent = a.send(b.address, RequestOutput(rid, (1,), None), src)
    ((_, got, kv),) = _recv(b)
    assert got.request_id == rid and b.load(kv, dst) == sent == len(src) * bs * 8
    for s_, d_ in zip(src, dst):
        assert (b.runner.slots[d_ * bs:(d_ + 1) * bs] == a.runner.slots[s_ * bs:(s_ + 1) * bs]).all()


class _ExpiringGets:
    """The real store, except that its next ``batch_get_into`` calls report
    LEASE_EXPIRED (-707) for some keys after reading them: what a get does
    when its transfer outlasts the object's lease (the master's
    ``--default_kv_lease_ttl``).  Injected, because a real expiry depends on
    timing: a loaded CI machine met it with the tests' 0.5 s lease, and a
    1 ms lease also expires on the retries there."""

    def __init__(self, store: Any, expire: list[int]) -> None:
        self.store, self.expire, self.calls = store, list(expire), []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def batch_get_into(self, keys: list[str], addrs: list[int], sizes: list[int]) -> list[int]:
        rcs = list(self.store.batch_get_into(keys, addrs, sizes))
        n = self.expire.pop(0) if self.expire else 0
        rcs[:n] = [-707] * min(n, len(rcs))
        self.calls.append((len(keys), n))
        return rcs


def test_mooncake_reads_blocks_again_when_their_lease_expired_mid_get(master: Any) -> None:
    """A get that reports LEASE_EXPIRED reads those blocks again (the
    handoff's objects are removed only by their receiver); after three tries,
    or for any other error, the load fails with the codes, and the keys are
    removed either way.  Before the retry, the handoff failed with a 500."""
    a, b = _pair("mooncake", master)
    try:
        bs = a.runner.block_size
        rng = np.random.default_rng(1)
        a.runner.slots[:] = rng.integers(0, 1 << 40, a.runner.slots.size)
        real = b.store
        b.store = spy = _ExpiringGets(real, [5, 2])  # 5 of 16 expire, then 2 of those 5
        sent = a.send(b.address, RequestOutput("r1", (1,), None), list(range(16)))
        ((_, _, kv),) = _recv(b)
        assert b.load(kv, list(range(16, 32))) == sent == 16 * bs * 8
        assert (b.runner.slots[16 * bs:32 * bs] == a.runner.slots[:16 * bs]).all()
        assert spy.calls == [(16, 5), (5, 2), (2, 0)] and b.stats()["lease_retries"] == 7
        assert a.store.batch_is_exist(kv[0]) == [0] * 16  # removed after the load, as always
        # expired on every try: the load fails after three
        b.store = _ExpiringGets(real, [16, 16, 16])
        a.send(b.address, RequestOutput("r2", (1,), None), list(range(16)))
        ((_, _, kv2),) = _recv(b)
        with pytest.raises(RuntimeError, match=r"batch_get_into of 16 KV blocks failed: \[-707\] \(16 blocks, try 3\)"):
            b.load(kv2, list(range(16, 32)))
        assert a.store.batch_is_exist(kv2[0]) == [0] * 16
        # another error (the objects are gone): no retry
        b.store = spy = _ExpiringGets(real, [])
        a.send(b.address, RequestOutput("r3", (1,), None), [1, 2])
        ((_, _, kv3),) = _recv(b)
        real.batch_remove(kv3[0], True)
        with pytest.raises(RuntimeError, match=r"batch_get_into of 2 KV blocks failed: \[-7\d\d\] \(2 blocks, try 1\)"):
            b.load(kv3, [16, 17])
        assert len(spy.calls) == 1
    finally:
        a.close()
        b.close()


def test_mooncake_puts_survive_a_dead_instances_segment_the_master_still_counts() -> None:
    """A restarted prefill instance sends while the master still counts the
    segment of the killed one (until its client_ttl, 10 s): every put
    succeeds (the sender's own segment is preferred), byte exact."""
    if not have_mooncake():
        pytest.skip("mooncake_master / mooncake.store not installed (pip install 'fdx[mooncake]')")
    with MooncakeMaster() as m:
        code = ("import os, sys, time; os.environ['MC_LOG_LEVEL'] = 'WARNING'\n"
                "from mooncake.store import MooncakeDistributedStore\n"
                "s = MooncakeDistributedStore()\n"
                f"print(s.setup('127.0.0.1', 'P2PHANDSHAKE', 64 << 20, 16 << 20, 'tcp', '', '{m.address}'), "
                "flush=True)\n"
                "time.sleep(120)\n")
        dead = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        try:
            assert dead.stdout is not None and dead.stdout.readline().strip() == b"0"
        finally:
            dead.kill()  # SIGKILL: its segment stays mounted on the master for client_ttl
            dead.wait(10)
        a, b = _pair("mooncake", m)
        try:
            assert m.capacity() == (64 + 32 + 32) << 20  # the dead segment is still counted
            a.runner.slots[:] = np.random.default_rng(1).integers(0, 1 << 40, a.runner.slots.size)
            for k in range(6):  # 48 block puts: a third of them would land in the dead segment
                _send_and_check(a, b, f"r{k}", list(range(8)), list(range(8 + k, 16 + k)))
        finally:
            a.close()
            b.close()


def test_mooncake_put_retries_the_blocks_whose_put_failed(master: Any) -> None:
    a, b = _pair("mooncake", master)

    class Flaky:  # the store, with blocks 1 and 3 of the first batch failing (-800: the transfer failed)
        def __init__(self, store: Any) -> None:
            self.store, self.calls = store, []

        def batch_put_from(self, keys: list[str], *args: Any) -> list[int]:
            rcs = self.store.batch_put_from(keys, *args)
            self.calls.append(list(keys))
            if len(self.calls) == 1:
                self.store.batch_remove([keys[1], keys[3]], True)
                rcs = [-800 if i in (1, 3) else r for i, r in enumerate(rcs)]
            return rcs

        def __getattr__(self, name: str) -> Any:
            return getattr(self.store, name)

    real = a.store
    a.store = flaky = Flaky(real)
    try:
        a.runner.slots[:] = np.random.default_rng(2).integers(0, 1 << 40, a.runner.slots.size)
        _send_and_check(a, b, "r", [2, 4, 6, 8], [1, 2, 3, 4])
        assert len(flaky.calls) == 2 and len(flaky.calls[1]) == 2  # only the two failed blocks again
        assert not set(flaky.calls[1]) & set(flaky.calls[0])  # under fresh keys
        assert real.batch_is_exist(flaky.calls[0] + flaky.calls[1]) == [0] * 6  # all removed after the load
    finally:
        a.store = real
        a.close()
        b.close()


def _pair_one(name: str, **opts: Any) -> Any:
    from fdx.core.plugins import get_plugins

    cfg = make_config(num_kv_blocks=32, scheduler="splitwise", splitwise_role="decode", kv_connector=name,
                      kv_connector_config=opts)
    return get_plugins().create("kv_connector", name, config=cfg, runner=EchoRunner(cfg))


def test_lost_and_unreachable_peers_are_reported_once() -> None:
    opts = {"connect_timeout": 0.5, "heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
    a, b = _pair("zmq", **opts)
    try:
        a.send(b.address, RequestOutput("hello", ()))
        _recv(b)
        b.close()  # the peer goes away
        deadline = time.monotonic() + 10
        lost: list[str] = []
        while not lost and time.monotonic() < deadline:
            lost = a.lost_peers()
            time.sleep(0.05)
        assert lost == [b.address]
        assert a.lost_peers() == []
        nowhere = free_tcp_address()
        a.send(nowhere, RequestOutput("x", ()))  # queued; nobody ever answers
        time.sleep(0.8)
        assert a.lost_peers() == [nowhere]
        with pytest.raises(ConnectionError, match="not a KV connector address"):
            a.send("http://example", RequestOutput("x", ()))
    finally:
        a.close()


def test_mooncake_connector_needs_a_reachable_master() -> None:
    if not have_mooncake():
        pytest.skip("mooncake not installed")
    with pytest.raises(ConfigError, match="mooncake_master .* failed"):
        _pair_one("mooncake", master=f"127.0.0.1:{free_tcp_address().rsplit(':', 1)[1]}")
