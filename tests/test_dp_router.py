"""Unit tests of the dp routing policy, reply merging and stats totals
(pure logic; the real replicas are exercised in tests/test_dp_serve.py)."""

from __future__ import annotations

import random

import pytest

from fdx.config import make_config
from fdx.core.errors import ConfigError
from fdx.core.ipc import IpcPaths
from fdx.core.messages import EngineStats
from fdx.plugins.deployments.dp import dp_size, replica_config, replica_paths
from fdx.plugins.deployments.dp_replicas import merge_replies, total_stats
from fdx.deploy.affinity import PrefixAffinityRouter, prefix_hashes

BS = 16


def _prompt(prefix: list[int], rng: random.Random, n: int = 40) -> list[int]:
    return prefix + [rng.randrange(50000) for _ in range(n)]


def test_prefix_hashes_are_a_chain_of_full_blocks() -> None:
    a = list(range(100))
    b = list(range(48)) + [7] * 52
    ha, hb = prefix_hashes(a, BS, 256), prefix_hashes(b, BS, 256)
    assert len(ha) == 6 and len(hb) == 6  # 100 // 16 full blocks
    assert ha[:3] == hb[:3] and ha[3] != hb[3] and ha[4] != hb[4]
    assert len(prefix_hashes(a, BS, 2)) == 2


def test_groups_stick_to_their_replica_and_spread_when_idle() -> None:
    rng = random.Random(0)
    r = PrefixAffinityRouter(2, BS)
    prefixes = [[rng.randrange(50000) for _ in range(512)] for _ in range(4)]
    first = [r.choose(_prompt(p, rng), {0: 0, 1: 0}) for p in prefixes]
    assert sorted(c.rank for c in first) == [0, 0, 1, 1]  # ties go to the replica given fewer requests
    assert all(c.reason == "load" for c in first)
    for _ in range(3):
        for g, p in enumerate(prefixes):
            c = r.choose(_prompt(p, rng), {0: 300, 1: 900})
            assert c.rank == first[g].rank and c.reason == "affinity" and c.matched_tokens == 512


def test_a_much_busier_replica_loses_its_affinity() -> None:
    rng = random.Random(1)
    r = PrefixAffinityRouter(2, BS, slack_tokens=1000)
    p = [rng.randrange(50000) for _ in range(512)]
    assert r.choose(_prompt(p, rng), {0: 0, 1: 0}).rank == 0
    # busier by less than matched (512) + slack (1000): stays
    assert r.choose(_prompt(p, rng), {0: 1400, 1: 0}).rank == 0
    c = r.choose(_prompt(p, rng), {0: 1600, 1: 0})
    assert (c.rank, c.reason) == (1, "load")
    # the prefix now lives on replica 1 too (latest placement wins)
    assert r.choose(_prompt(p, rng), {0: 0, 1: 0}).rank == 1


def test_dead_or_restarted_replicas_are_not_sticky() -> None:
    rng = random.Random(2)
    r = PrefixAffinityRouter(2, BS)
    p = [rng.randrange(50000) for _ in range(256)]
    assert r.choose(_prompt(p, rng), {0: 0, 1: 0}).rank == 0
    assert r.choose(_prompt(p, rng), {1: 0}).rank == 1  # replica 0 is down
    assert r.choose(_prompt(p, rng), {0: 0, 1: 0}).rank == 1
    r.replica_restarted(1)  # its cache is empty now
    c = r.choose(_prompt(p, rng), {0: 10, 1: 0})
    assert (c.rank, c.reason) == (1, "load")
    with pytest.raises(ValueError):
        r.choose(p, {})


def test_short_prompts_route_by_load() -> None:
    r = PrefixAffinityRouter(3, BS)
    assert r.choose([1, 2, 3], {0: 50, 1: 10, 2: 30}).rank == 1


def test_the_table_is_bounded() -> None:
    rng = random.Random(3)
    r = PrefixAffinityRouter(2, BS, capacity=100)
    for _ in range(20):
        r.choose([rng.randrange(50000) for _ in range(160)], {0: 0, 1: 0})
    assert len(r.table) == 100


def test_merged_replies() -> None:
    m = merge_replies("pause", {0: {"is_paused": True, "num_aborted": 2}, 1: {"is_paused": True, "num_aborted": 1}})
    assert m["is_paused"] is True and m["num_aborted"] == 3 and [x["dp_rank"] for x in m["replicas"]] == [0, 1]
    m = merge_replies("is_paused", {0: {"is_paused": True, "sleeping": ["weight"]},
                                    1: {"is_paused": False, "sleeping": []}})
    assert m["is_paused"] is False and m["sleeping"] == ["weight"]
    m = merge_replies("abort_requests", {0: {"aborted": [{"request_id": "a", "output_token_count": 3}],
                                             "not_found": ["b"]},
                                         1: {"aborted": [{"request_id": "b", "output_token_count": 1}],
                                             "not_found": ["a"]}})
    assert [a["request_id"] for a in m["aborted"]] == ["a", "b"] and m["not_found"] == []
    m = merge_replies("sleep", {0: {"sleeping": ["kv_cache", "weight"], "released": ["weight"], "rss_before": 5,
                                    "rss_after": 2},
                                1: {"sleeping": ["weight"], "released": ["weight"], "rss_before": 4, "rss_after": 1}})
    assert m["sleeping"] == ["kv_cache", "weight"] and m["rss_before"] == 9 and m["rss_after"] == 3
    assert merge_replies("custom", {0: {"x": 1}, 1: {"x": 1}}) == {"x": 1}
    assert merge_replies("custom", {0: {"x": 1}, 1: {"x": 2}})["replicas"][1] == {"dp_rank": 1, "x": 2}


def test_total_stats() -> None:
    a = EngineStats(num_running=2, num_waiting=1, kv_blocks_total=10, kv_blocks_used=4, prefix_hits=7, steps=3,
                    is_paused=True, weights_version="v1", expert_tokens=((0, "0", 5), (1, "1", 2)))
    b = EngineStats(num_running=1, kv_blocks_total=10, kv_blocks_used=1, prefix_hits=1, steps=5, is_paused=False,
                    weights_version="v1", expert_tokens=((0, "0", 1), (1, "1", 4)))
    t = total_stats([a, b])
    assert t.expert_tokens == ((0, "0", 6), (1, "1", 6))  # a MoE model's per-expert load, summed per expert
    assert (t.num_running, t.num_waiting, t.kv_blocks_total, t.kv_blocks_used, t.prefix_hits, t.steps) == \
        (3, 1, 20, 5, 8, 8)
    assert t.is_paused is False and t.weights_version == "v1" and t.kv_usage == 0.25
    assert total_stats([a, attrs_paused(b)]).is_paused is True


def attrs_paused(s: EngineStats) -> EngineStats:
    import attrs

    return attrs.evolve(s, is_paused=True)


def test_topology(tmp_path) -> None:  # type: ignore[no-untyped-def]
    single = make_config()
    assert dp_size(single) == 1 and replica_config(single, 0) is single
    assert replica_paths(IpcPaths(str(tmp_path)), single) == [IpcPaths(str(tmp_path))]
    cfg = make_config(scheduler="dp", data_parallel_size=3, dp_local_scheduler="v0", num_threads=1)
    assert dp_size(cfg) == 3
    rc = replica_config(cfg, 2)
    assert (rc.scheduler, rc.dp_rank, rc.data_parallel_size, rc.num_threads) == ("v0", 2, 1, 1)
    paths = replica_paths(IpcPaths(str(tmp_path)), cfg)
    assert [p.dir for p in paths] == [str(tmp_path / f"dp{r}") for r in range(3)]
    assert all((tmp_path / f"dp{r}").is_dir() for r in range(3))


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="--data-parallel-size 2 needs --scheduler dp"):
        make_config(data_parallel_size=2)
    with pytest.raises(ConfigError, match="--dp-local-scheduler"):
        make_config(scheduler="dp", dp_local_scheduler="dp")
    with pytest.raises(ConfigError, match="--data-parallel-size must be > 0"):
        make_config(scheduler="dp", data_parallel_size=0)


def test_inside_one_engine_dp_is_the_local_policy() -> None:
    from fdx.core.kv_cache import KVCacheManager
    from fdx.core.plugins import get_plugins
    from fdx.plugins.schedulers.v0 import V0Scheduler
    from fdx.plugins.schedulers.v1 import V1Scheduler

    plugins = get_plugins()
    assert "dp" in plugins.registry("scheduler").names()
    for local, cls in (("v0", V0Scheduler), ("v1", V1Scheduler)):
        cfg = make_config(scheduler="dp", dp_local_scheduler=local)
        sched = plugins.create("scheduler", "dp", config=cfg, kv=KVCacheManager(64, 16, True))
        assert type(sched) is cls
