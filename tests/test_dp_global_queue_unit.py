"""The dp global queue's pure parts, no Redis: which requests can go on
elsewhere as a continuation, and how the nodes' replies to a control call
merge (every node listed; any failure fails the call, naming the nodes)."""

from __future__ import annotations

import pytest

from fdx.core.messages import SamplingParams
from fdx.deploy.frontend import ControlCallError
from fdx.plugins.deployments.dp_global_queue import continuable, merge_node_replies, state_fields, state_steps


def test_only_requests_that_sample_as_they_would_have_are_continued() -> None:
    assert continuable(SamplingParams(max_tokens=8, temperature=0), 3)
    assert continuable(SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9), 3)  # unseeded: any sample is fine
    assert not continuable(SamplingParams(max_tokens=8), 8)  # nothing left to make
    for bad in (dict(seed=1), dict(presence_penalty=0.5), dict(frequency_penalty=0.5), dict(repetition_penalty=1.1),
                dict(beam_width=2), dict(prompt_logprobs=1)):
        assert not continuable(SamplingParams(max_tokens=8, **bad), 3), bad


def test_node_replies_merge_like_replica_replies_and_list_every_node() -> None:
    ok = {"a~1": {"ok": True, "result": {"is_paused": True, "replicas": [{"dp_rank": 0, "is_paused": True}]}},
          "b~2": {"ok": True, "result": {"is_paused": True, "replicas": [{"dp_rank": 0, "is_paused": True}]}}}
    merged = merge_node_replies("is_paused", ok)
    assert merged["is_paused"] is True and [n["instance"] for n in merged["nodes"]] == ["a~1", "b~2"]
    assert "replicas" not in merged and merged["nodes"][0]["replicas"] == [{"dp_rank": 0, "is_paused": True}]
    half = {**ok, "b~2": {"ok": True, "result": {"is_paused": False}}}
    assert merge_node_replies("is_paused", half)["is_paused"] is False  # all nodes, not any


def test_a_failed_node_fails_the_call_naming_it_and_the_nodes_that_succeeded() -> None:
    replies = {"a~1": {"ok": True, "result": {"is_paused": True}},
               "b~2": {"ok": False, "code": 504, "error": "no reply within 1s"},
               "c~3": {"ok": False, "code": 400, "error": "bad"}}
    with pytest.raises(ControlCallError) as e:
        merge_node_replies("pause", replies)
    assert e.value.code == 504
    assert str(e.value) == "dp node b~2: no reply within 1s; dp node c~3: bad (succeeded on: a~1)"


def test_a_node_reaches_the_cluster_state_through_local_control_calls_in_order() -> None:
    fresh = dict(paused=False, sleeping=(), version="m")
    assert state_steps({"paused": True, "rev": 1}, **fresh) == [("pause", {})]
    assert state_steps({"paused": False, "rev": 2}, **fresh) == []
    assert state_steps({"paused": True, "sleeping": ["kv_cache", "weight"]}, **fresh) == [
        ("sleep", {"tags": ["kv_cache", "weight"]})]  # sleep pauses by itself
    assert state_steps({"paused": False, "sleeping": {}, "weights": {"path": "/w", "version": "v2"}}, **fresh) == [
        ("pause", {}), ("update_weights", {"path": "/w", "version": "v2"}), ("resume", {})]
    assert state_steps({"paused": True, "weights": {"path": "/w", "version": "v2"}},
                       paused=True, sleeping=(), version="v2") == []  # already so
    assert state_steps({"paused": True, "weights": {"path": "/w", "version": "v2"}},
                       paused=True, sleeping=("weight",), version="m") == [
        ("wakeup", {}), ("pause", {}), ("update_weights", {"path": "/w", "version": "v2"})]
    assert state_steps({"paused": False}, paused=True, sleeping=("weight",), version="m") == [("wakeup", {})]


def test_state_fields_follow_the_merged_reply() -> None:
    assert state_fields("pause", {}, {"is_paused": True}) == {"paused": True}
    assert state_fields("sleep", {"tags": ["weight"]}, {"sleeping": ["weight"]}) == {
        "paused": True, "sleeping": ["weight"]}
    assert state_fields("wakeup", {}, {"sleeping": [], "is_paused": False}) == {"paused": False, "sleeping": []}
    assert state_fields("update_weights", {"path": "/w", "version": "v2"}, {}) == {
        "weights": {"path": "/w", "version": "v2"}}
