"""The router's record of the deployment's control state (fdx/router/state.py):
what each successful call makes of it (the engine's rules, fdx/engine_control.py),
and its ``--state-file`` across a router restart.  Applying it to a restarted
instance is tested end to end in tests/test_splitwise_restart_state.py."""

from __future__ import annotations

from pathlib import Path

from fdx.router.state import ControlState, DesiredState, Weights, next_state

START = DesiredState()


def test_each_stateful_call_follows_the_engines_rules() -> None:
    paused = next_state(START, "pause", {}, {})
    assert paused == DesiredState(paused=True)
    assert next_state(paused, "resume", {}, {}) == START
    # sleep pauses; default tags are both; vLLM's /sleep (level) is both too
    both = DesiredState(paused=True, sleeping=("weight", "kv_cache"))
    assert next_state(START, "sleep", {}, {}) == both
    assert next_state(START, "sleep", {"level": "1"}, {}) == both
    kv = next_state(START, "sleep", {"tags": "kv_cache"}, {})
    assert kv == DesiredState(paused=True, sleeping=("kv_cache",))
    # wakeup: only the tags named (vLLM's "weights" is "weight"); resumes when nothing is left asleep
    assert next_state(both, "wakeup", {"tags": ["weights"]}, {}) == kv
    assert next_state(both, "wakeup", {"tags": "weight,kv_cache"}, {}) == START
    assert next_state(both, "wakeup", {}, {}) == START
    assert next_state(paused, "wakeup", {}, {}) == START  # nothing asleep: a wakeup resumes
    # update_weights: the client's path and version (default: the path), as the merged reply has them
    w = next_state(paused, "update_weights", {"path": "a.gguf", "version": 3}, {"path": "a.gguf", "version": "3"})
    assert w == DesiredState(paused=True, weights=Weights("a.gguf", "3"))
    assert next_state(paused, "update_weights", {"path": "b"}, {}).weights == Weights("b", "b")
    # the weights stay across pause/resume/sleep
    assert next_state(next_state(w, "resume", {}, {}), "sleep", {"tags": ["kv_cache"]}, {}).weights == w.weights
    # not stateful: nothing changes
    assert next_state(w, "abort_requests", {"abort_all": True}, {}) == w


def test_unknown_until_a_call_succeeded_then_kept_in_the_state_file(tmp_path: Path) -> None:
    path = str(tmp_path / "state.json")
    s = ControlState({}, path)
    assert s.desired is None and s.describe() is None
    s.record("is_paused", {}, {"is_paused": False})  # a read changes nothing
    assert s.desired is None
    s.record("sleep", {"tags": "kv_cache"}, {})
    s.record("update_weights", {"path": "/w/x.gguf", "version": "v2"}, {"path": "/w/x.gguf", "version": "v2"})
    want = {"is_paused": True, "sleeping": ["kv_cache"], "weights": {"path": "/w/x.gguf", "version": "v2"}}
    assert s.describe() == want
    # a restarted router reads it back
    assert ControlState({}, path).describe() == want
    # a broken file: no state (nothing applied), not a crash
    (tmp_path / "state.json").write_text("{not json")
    assert ControlState({}, path).desired is None
