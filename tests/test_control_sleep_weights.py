"""Control plane end to end (issue 6): sleep / wakeup (real RSS drop of the
engine process) and update_weights (swap to a perturbed Hugging Face copy
written here, then back to the GGUF) against a real ``fdx serve``.

The KV pool is sized with ``--num-kv-blocks`` so the freed bytes are known:
weights = every GGUF tensor as float32 (what the runner holds), KV =
blocks x layers x 2 x kv_heads x block_size x head_dim x 4 bytes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any, Iterator

import httpx
import numpy as np
import pytest

from controlutil import control, engine_pid, greedy, greedy_text, metric, ok, rss_bytes
from serverutil import start_server

pytestmark = pytest.mark.slow

NUM_KV_BLOCKS = 512
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from fdx.model.source import embedded_gguf_path

    # update_weights loads the checkpoints written under the session's temp
    # root and, to swap back, the embedded model
    allowed = (str(tmp_path_factory.getbasetemp()), os.path.dirname(embedded_gguf_path()))
    # float32 compute: model_bytes() counts float32 weights (int8 compute keeps packed blocks instead)
    with start_server("--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--allowed-weights-dir", allowed[0],
                      "--allowed-weights-dir", allowed[1]) as (base, _proc):
        yield base


@pytest.fixture(autouse=True)
def _awake(server: str) -> Iterator[None]:
    yield
    ok(server, "wakeup")
    assert ok(server, "is_paused", method="GET") == {"is_paused": False, "sleeping": []}


def outputs(base: str) -> list[str]:
    texts = [greedy_text(base, p, 24) for p in PROMPTS]
    r = httpx.post(base + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 24, "temperature": 0},
                   timeout=600)
    assert r.status_code == 200, r.text
    return texts + [r.json()["choices"][0]["message"]["content"]]


@pytest.fixture(scope="module")
def baseline(server: str) -> list[str]:
    first = outputs(server)
    assert outputs(server) == first, "the engine is not deterministic: output comparisons would be meaningless"
    return first


def model_bytes() -> tuple[int, int]:
    """(float32 weight bytes, bytes per KV block) of the embedded model."""
    from fdx.model.gguf_file import GGUFFile
    from fdx.model.source import embedded_gguf_path

    g = GGUFFile(embedded_gguf_path())
    weights = sum(int(np.prod(t.shape)) * 4 for t in g.tensors.values())
    layers = int(g.get("llama.block_count"))
    kv_heads = int(g.get("llama.attention.head_count_kv"))
    head_dim = int(g.get("llama.embedding_length")) // int(g.get("llama.attention.head_count"))
    return weights, layers * 2 * kv_heads * 16 * head_dim * 4


# --------------------------------------------------------------------------
# sleep / wakeup
# --------------------------------------------------------------------------


def test_sleep_frees_weights_and_kv_then_wakeup_is_identical(server: str, baseline: list[str]) -> None:
    pid = engine_pid(server)
    assert metric(server, "fdx:kv_blocks_total") == NUM_KV_BLOCKS
    weights, per_block = model_bytes()
    freeable = weights + NUM_KV_BLOCKS * per_block
    before = rss_bytes(pid)
    res = ok(server, "sleep", params={"tags": "weight,kv_cache"})
    after = rss_bytes(pid)
    assert res["released"] == ["weight", "kv_cache"]
    dropped = before - after
    print(f"\nsleep weight,kv_cache: engine RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB, dropped "
          f"{dropped / 2**20:.0f} MiB = {dropped / freeable:.0%} of weights {weights / 2**20:.0f} MiB + "
          f"KV {NUM_KV_BLOCKS * per_block / 2**20:.0f} MiB")
    assert dropped >= 0.7 * freeable, (before, after, freeable)
    # asleep: paused, requests get 503, resume is refused
    assert ok(server, "is_paused", method="GET") == {"is_paused": True, "sleeping": ["kv_cache", "weight"]}
    code, js = greedy(server, PROMPTS[0])
    assert code == 503, js
    code, js = control(server, "resume")
    assert code == 400 and "wakeup" in js["message"]
    # sleeping again is a no-op
    assert ok(server, "sleep")["released"] == []
    res = ok(server, "wakeup", params={"tags": "weight,kv_cache"})
    assert res == {"restored": ["weight", "kv_cache"], "sleeping": [], "is_paused": False}
    assert rss_bytes(pid) - after >= 0.7 * freeable
    assert outputs(server) == baseline


def test_sleep_kv_cache_only(server: str, baseline: list[str]) -> None:
    pid = engine_pid(server)
    _, per_block = model_bytes()
    before = rss_bytes(pid)
    ok(server, "sleep", {"tags": ["kv_cache"]})
    after = rss_bytes(pid)
    assert before - after >= 0.7 * NUM_KV_BLOCKS * per_block, (before, after)
    # a partial wakeup of something not asleep restores nothing; the engine stays paused
    assert ok(server, "wakeup", params={"tags": "weight"}) == {"restored": [], "sleeping": ["kv_cache"],
                                                                  "is_paused": True}
    assert ok(server, "wakeup", params={"tags": "kv_cache"})["is_paused"] is False
    assert outputs(server) == baseline


def test_bodyless_sleep_and_vllm_sleep_wake_up(server: str, baseline: list[str]) -> None:
    def post(path: str, **kw: Any) -> httpx.Response:  # no body, no content type: what curl -X POST sends
        return httpx.post(server + path, timeout=600, **kw)

    # FastDeploy's form, arguments in the query string only (vLLM's 'weights' spelling accepted)
    r = post("/v1/sleep", params={"tags": "weights"})
    assert r.status_code == 200 and r.json()["result"]["released"] == ["weight"], r.text
    r = post("/v1/wakeup")
    assert r.status_code == 200 and r.json()["result"]["restored"] == ["weight"], r.text
    # vLLM's: POST /sleep?level=1 and POST /wake_up answer an empty 200; /is_sleeping says so
    r = post("/sleep", params={"level": "1"})
    assert r.status_code == 200 and r.content == b"", r.text
    assert httpx.get(server + "/is_sleeping", timeout=60).json() == {"is_sleeping": True}
    assert httpx.get(server + "/is_paused", timeout=60).json() == {"is_paused": True}
    assert ok(server, "is_paused", method="GET")["sleeping"] == ["kv_cache", "weight"]
    assert greedy(server, PROMPTS[0])[0] == 503
    r = post("/wake_up", params=[("tags", "weights")])  # a partial wake-up: still asleep, still paused
    assert r.status_code == 200 and r.content == b"", r.text
    assert ok(server, "is_paused", method="GET") == {"is_paused": True, "sleeping": ["kv_cache"]}
    r = post("/wake_up", params=[("tags", "kv_cache")])
    assert r.status_code == 200, r.text
    assert httpx.get(server + "/is_sleeping", timeout=60).json() == {"is_sleeping": False}
    r = post("/sleep", params={"level": "2"})
    assert r.status_code == 200, r.text
    assert post("/wake_up").status_code == 200  # no tags: everything asleep
    assert httpx.get(server + "/is_sleeping", timeout=60).json() == {"is_sleeping": False}
    assert outputs(server) == baseline


# --------------------------------------------------------------------------
# update_weights
# --------------------------------------------------------------------------


def _hf_config(args: Any, **override: Any) -> dict[str, Any]:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rope_theta": args.rope_theta,
        "rms_norm_eps": args.rms_eps,
        "max_position_embeddings": args.max_position,
        "tie_word_embeddings": args.tie_embeddings,
    }
    cfg.update(override)
    return cfg


@pytest.fixture(scope="module")
def perturbed_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Hugging Face (config.json + safetensors, float16) copy of the
    embedded model with a perturbed embedding / LM head and FFN."""
    from safetensors.numpy import save_file

    from fdx.model.loader import load_checkpoint

    ckpt = load_checkpoint("smollm2")
    rng = np.random.default_rng(0)
    embed = ckpt.embed + rng.standard_normal(ckpt.embed.shape, dtype=np.float32) * (0.5 * float(ckpt.embed.std()))
    tensors = {"model.embed_tokens.weight": embed.astype(np.float16),
               "model.norm.weight": ckpt.final_norm.astype(np.float16)}
    for i, lw in enumerate(ckpt.layers()):
        p = f"model.layers.{i}."
        for name, w in (("input_layernorm", lw.attn_norm), ("self_attn.q_proj", lw.wq), ("self_attn.k_proj", lw.wk),
                        ("self_attn.v_proj", lw.wv), ("self_attn.o_proj", lw.wo),
                        ("post_attention_layernorm", lw.ffn_norm), ("mlp.gate_proj", lw.w_gate),
                        ("mlp.up_proj", lw.w_up), ("mlp.down_proj", lw.w_down * 0.8)):
            tensors[p + name + ".weight"] = np.ascontiguousarray(w, dtype=np.float16)
    folder = tmp_path_factory.mktemp("perturbed-smollm2")
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_hf_config(ckpt.args)))
    return str(folder)


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint with a different architecture (2 layers, hidden 64)."""
    from safetensors.numpy import save_file

    from fdx.model.loader import load_checkpoint

    args = load_checkpoint("smollm2").args
    folder = tmp_path_factory.mktemp("small-llama")
    cfg = _hf_config(args, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    (folder / "config.json").write_text(json.dumps(cfg))
    z = lambda *s: np.zeros(s, dtype=np.float16)  # noqa: E731
    tensors = {"model.embed_tokens.weight": z(args.vocab_size, 64), "model.norm.weight": z(64)}
    for i in range(2):  # a complete checkpoint: the refusal is about its shape, not a missing tensor
        pre = f"model.layers.{i}."
        tensors.update({pre + "input_layernorm.weight": z(64), pre + "post_attention_layernorm.weight": z(64),
                        pre + "self_attn.q_proj.weight": z(64, 64), pre + "self_attn.k_proj.weight": z(32, 64),
                        pre + "self_attn.v_proj.weight": z(32, 64), pre + "self_attn.o_proj.weight": z(64, 64),
                        pre + "mlp.gate_proj.weight": z(128, 64), pre + "mlp.up_proj.weight": z(128, 64),
                        pre + "mlp.down_proj.weight": z(64, 128)})
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def test_update_weights_swaps_and_restores(server: str, baseline: list[str], perturbed_folder: str,
                                           small_folder: str) -> None:
    from fdx.model.source import embedded_gguf_path

    original = embedded_gguf_path()
    pid = engine_pid(server)
    rss_start = rss_bytes(pid)
    # refused while serving
    code, js = control(server, "update_weights", {"path": perturbed_folder, "version": "perturbed-1"})
    assert code == 400 and "pause" in js["message"], js
    # bad calls while paused
    ok(server, "pause")
    code, js = control(server, "update_weights", {"version": "x"})
    assert code == 400 and "path" in js["message"]
    missing = os.path.join(os.path.dirname(small_folder), "no-such-model.gguf")  # inside an allowed dir
    code, js = control(server, "update_weights", {"path": missing})
    assert code == 400 and "not found" in js["message"], js
    # outside every allowed dir: the same 403 whether the file exists or not
    outside = [control(server, "update_weights", {"path": p}) for p in ("/no/such/model.gguf", "/etc/passwd")]
    assert outside[0] == outside[1] and outside[0][0] == 403, outside
    code, js = control(server, "update_weights", {"path": small_folder, "version": "small"})
    assert code == 400 and "num_layers=2 (running 30)" in js["message"] and "hidden_size=64" in js["message"], js
    # swap to the perturbed copy: version recorded, output changes
    assert ok(server, "update_weights", {"path": perturbed_folder, "version": "perturbed-1"})["version"] == \
        "perturbed-1"
    assert httpx.get(server + "/v1/models", timeout=30).json()["data"][0]["version"] == "perturbed-1"
    ok(server, "resume")
    changed = outputs(server)
    assert changed != baseline
    assert sum(a != b for a, b in zip(changed, baseline)) >= 3, (changed, baseline)
    # sleep + wakeup restores the *updated* weights
    ok(server, "sleep", params={"tags": "weight"})
    code, js = control(server, "update_weights", {"path": original})
    assert code == 400 and "asleep" in js["message"]
    ok(server, "wakeup")
    assert outputs(server) == changed
    # a failing method is a 500 with the reason; the engine stays paused and asleep until a wakeup works
    ok(server, "sleep", params={"tags": "weight"})
    st = os.path.join(perturbed_folder, "model.safetensors")
    os.rename(st, st + ".moved")
    try:
        code, js = control(server, "wakeup")
        assert code == 500 and "control method wakeup failed" in js["message"] and "safetensors" in js["message"], js
        assert ok(server, "is_paused", method="GET") == {"is_paused": True, "sleeping": ["weight"]}
        assert greedy(server, PROMPTS[0])[0] == 503
    finally:
        os.rename(st + ".moved", st)
    ok(server, "wakeup")
    assert outputs(server) == changed
    # swap back: identical output to before
    ok(server, "pause")
    assert ok(server, "update_weights", {"path": original, "version": "orig"})["version"] == "orig"
    ok(server, "resume")
    assert httpx.get(server + "/v1/models", timeout=30).json()["data"][0]["version"] == "orig"
    assert outputs(server) == baseline
    # the replaced weights' memory was returned: RSS did not grow by a copy per swap
    weights, _ = model_bytes()
    grown = rss_bytes(pid) - rss_start
    print(f"\nupdate_weights x2 (+ sleep/wakeup): engine RSS grew {grown / 2**20:.0f} MiB "
          f"(weights are {weights / 2**20:.0f} MiB)")
    assert grown < 0.3 * weights, grown
    # a supervisor restart keeps the control state: SIGKILL the engine while paused on perturbed-2
    ok(server, "pause")
    ok(server, "update_weights", {"path": perturbed_folder, "version": "perturbed-2"})
    restarts = metric(server, "fdx:engine_restarts_total")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(server + "/health", timeout=5).status_code == 200 and engine_pid(server) != pid:
                break
        except (httpx.HTTPError, AssertionError):
            pass
        time.sleep(0.5)
    assert engine_pid(server) != pid, "no new engine within 180 s"
    assert metric(server, "fdx:engine_restarts_total") == restarts + 1
    assert ok(server, "is_paused", method="GET") == {"is_paused": True, "sleeping": []}
    assert httpx.get(server + "/v1/models", timeout=30).json()["data"][0]["version"] == "perturbed-2"
    assert greedy(server, PROMPTS[0])[0] == 503
    ok(server, "resume")
    assert outputs(server) == changed  # the restored weights are the updated ones
    ok(server, "pause")
    ok(server, "update_weights", {"path": original, "version": "orig"})
    ok(server, "resume")
