"""Tensor parallelism of the ``gpu`` runner, checked on the CPU place in
float32 (its plain-Paddle path) over gloo, with real rank processes: the
runner driven by hand at TP=2 against TP=1, the backend rules, an
indivisible model refused, and one real ``fdx serve --model-runner gpu -tp 2``
that matches TP=1 and recovers from a killed rank.  The NCCL path (the same
code with ``NcclComm``) runs only on a GPU machine: ``bench/device_check``."""

from __future__ import annotations

import signal
from typing import Any

import httpx
import pytest
from serverutil import read_log, serve_command, start_server
from test_tensor_parallel import (  # noqa: F401 - random_llama: the fixture
    assert_same,
    completions,
    lose_a_rank_under_16_streams,
    random_llama,
)

from fdx.core.errors import ConfigError
from fdx.core.interfaces import ScheduledBatch, ScheduledSeq
from fdx.core.messages import SamplingParams
from fdx.core.request import Request

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 33, 71, 2, 100, 400, 17], [7, 7, 7, 8, 301, 12], list(range(20, 61, 3))]


def greedy_with_logprobs(runner: Any, prompts: list[list[int]], n: int, chunk: int = 8) -> list[list[tuple[int, float]]]:
    """Every prompt at once (prefill in ``chunk``-token pieces mixed with the
    others' decodes, one ``execute`` per step): each one's ``(token, logprob)``s."""
    bs = runner.block_size
    reqs = [Request(f"r{i}", list(p), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0),
                    eos_token_ids=runner.eos_token_ids, max_model_len=runner.max_model_len)
            for i, p in enumerate(prompts)]
    free = list(range(runner.num_kv_blocks))
    for r, p in zip(reqs, prompts):
        r.block_ids.extend(free.pop() for _ in range(-(-(len(p) + n) // bs)))
    out: list[list[tuple[int, float]]] = [[] for _ in reqs]
    live = list(range(len(reqs)))
    while live:
        seqs = [ScheduledSeq(reqs[i], min(chunk, reqs[i].num_tokens - reqs[i].num_computed_tokens)) for i in live]
        samples = [s.samples for s in seqs]
        res = runner.execute(ScheduledBatch(seqs))
        for j, (i, s, smp) in enumerate(zip(live, seqs, samples)):
            s.request.num_computed_tokens += s.num_new_tokens
            if smp:
                tok = int(res.token_ids[j])
                lp = res.logprobs[j] if res.logprobs else None
                assert lp is not None and lp.token_id == tok
                out[i].append((tok, lp.logprob))
                if s.request.append_token(tok):
                    s.request.finish_reason = "length"
        live = [i for i in live if reqs[i].finish_reason is None]
    return out


def _runner(model: str, tp: int, **kw: Any) -> Any:
    from fdx.config import make_config
    from fdx.model.gpu_runner import GPUModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    cfg = make_config(model=model, model_runner="gpu", device="cpu", dtype="float32", max_model_len=512,
                      num_kv_blocks=64, tensor_parallel_size=tp, num_threads=1, step_timeout=20, **kw)
    return GPUModelRunner(cfg, CPUDevice())


_MOE_CHECK = """
import json, sys
sys.path.insert(0, sys.argv[3])
from test_gpu_tensor_parallel import PROMPTS, _runner, greedy_with_logprobs
model, ep = sys.argv[1], sys.argv[2] == "ep"
one = _runner(model, 1)
want = greedy_with_logprobs(one, PROMPTS, 16)
del one
two = _runner(model, 2, enable_expert_parallel=ep)
held = two.model.layers[0].moe.num_experts
got = greedy_with_logprobs(two, PROMPTS, 16)
two.close()
from fdx.core.errors import FdxError
try:  # Paddle makes one collective group per process: a second is refused, not waited on
    _runner(model, 2, enable_expert_parallel=ep)
    again = "built"
except FdxError as exc:
    again = str(exc)
print(json.dumps({"want": want, "got": got, "held": held, "experts": two.args.num_experts, "again": again}))
"""


@pytest.mark.parametrize(("name", "ep"), [("qwen3_moe", False), ("mixtral", True)])
def test_gpu_runner_moe_at_tp2_and_ep2_matches_one_rank(name: str, ep: bool) -> None:
    """A mixture of experts on the gpu runner: each expert's width split over
    2 ranks (Megatron), or the experts split whole (``--enable-expert-parallel``),
    gives one rank's greedy tokens, logprobs within 1e-4.  In its own process:
    rank 0 joins Paddle's gloo group once per process."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    out = subprocess.run([sys.executable, "-c", _MOE_CHECK, str(here / "data" / "arch" / name), "ep" if ep else "tp",
                          str(here)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["held"] == (r["experts"] // 2 if ep else r["experts"])
    assert "already joined a Paddle collective group" in r["again"], r["again"]
    for w, g in zip(r["want"], r["got"]):
        assert [t for t, _ in w] == [t for t, _ in g], (name, ep)
        assert max(abs(a - b) for (_, a), (_, b) in zip(w, g)) < 1e-4, (name, ep)


def test_gpu_runner_at_tp2_over_gloo_matches_one_rank(random_llama: str) -> None:
    one = _runner(random_llama, 1)
    want = greedy_with_logprobs(one, PROMPTS, 24)
    blocks_one = one.read_kv_blocks([63])
    del one
    two = _runner(random_llama, 2)
    try:
        assert two.tensor_parallel_size == 2 and two.comm.backend == "gloo" and len(two.rank_pids) == 1
        assert two.kv_args.num_heads == two.args.num_heads // 2  # this rank holds half the heads
        got = greedy_with_logprobs(two, PROMPTS, 24)
        for w, g in zip(want, got):
            assert [t for t, _ in w] == [t for t, _ in g]
            assert max(abs(a - b) for (_, a), (_, b) in zip(w, g)) < 1e-4
        # a KV block is the ranks' shards in rank order: as many bytes as one rank's whole block
        blocks_two = two.read_kv_blocks([63])
        assert len(blocks_two[0]) == len(blocks_one[0])
        two.write_kv_blocks([0], blocks_two)
        assert two.read_kv_blocks([0]) == blocks_two
        # sleep and wake-up act on every rank: the weights come back from each rank's shard
        two.release(["weight", "kv_cache"])
        two.restore(["weight", "kv_cache"])
        again = greedy_with_logprobs(two, PROMPTS[:1], 24)
        assert [t for t, _ in again[0]] == [t for t, _ in want[0]]
    finally:
        two.close()


def test_backend_rules_and_an_indivisible_model(random_llama: str) -> None:
    from fdx.config import make_config

    def backend(**kw: Any) -> str:
        return make_config(tensor_parallel_size=2, **kw).tp_backend  # type: ignore[no-any-return]

    assert backend(model_runner="gpu", device="cpu") == "gloo"
    assert backend(device="cuda") == "nccl"  # the gpu runner is cuda's default
    assert backend(model_runner="gpu", device="cuda:1") == "nccl"
    assert backend() == "shm"  # the cpu runner keeps its own
    with pytest.raises(ConfigError, match="--tp-backend shm: shared memory is the cpu runner's"):
        make_config(tensor_parallel_size=2, model_runner="gpu", device="cpu", tp_backend="shm")
    with pytest.raises(ConfigError, match="--tp-backend nccl: NCCL joins the gpu runner's ranks on CUDA GPUs"):
        make_config(tensor_parallel_size=2, model_runner="gpu", device="cpu", tp_backend="nccl")
    with pytest.raises(ConfigError, match="--tp-backend nccl"):
        make_config(tensor_parallel_size=2, tp_backend="nccl")  # the cpu runner
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3: the model.s attention heads 4, .*not divisible by 3"):
        _runner(random_llama, 3)


def test_fewer_gpus_than_ranks_is_refused() -> None:
    from fdx.config import make_config
    from fdx.model.gpu_runner import check_rank_devices
    from fdx.plugins.hardware.cuda import CUDADevice

    class TwoGPUs(CUDADevice):  # what the check reads of a cuda device: its index and the visible count
        def _count(self) -> int:
            return 2

    cfg = make_config(tensor_parallel_size=2, device="cuda:1")
    with pytest.raises(Exception, match=r"gpu:1\.\.gpu:2 on this node\), but 2 GPU\(s\) are visible"):
        check_rank_devices(cfg, TwoGPUs(1), "gpu:1")
    check_rank_devices(cfg.replace(device="cuda"), TwoGPUs(0), "gpu:0")  # gpu:0 and gpu:1: fine
    check_rank_devices(cfg.replace(device="cuda"), TwoGPUs(1), "gpu:1")  # rank 1, on its own device
    with pytest.raises(Exception, match="nccl on CUDA GPUs"):
        check_rank_devices(cfg.replace(device="cuda", tp_backend="gloo"), TwoGPUs(0), "gpu:0")


def test_fdx_serve_gpu_runner_tp2_matches_one_rank_and_recovers_from_a_killed_rank(random_llama: str) -> None:
    args = ("--model", random_llama, "--model-runner", "gpu", "--device", "cpu", "--dtype", "float32",
            "--max-model-len", "512", "--num-kv-blocks", "256", "--max-num-seqs", "16")
    with start_server(*args, default_args=()) as (base, _):
        one = completions(base, 32)
    with start_server(*args, "-tp", "2", "--step-timeout", "8", default_args=(), timeout=300) as (base, proc):
        assert_same(one, completions(base, 32))
        text = httpx.get(base + "/metrics").text
        assert 'fdx:tensor_parallel_info{backend="gloo"' in text and 'size="2"' in text
        log = read_log(proc)
        assert "[tp rank 1] gpu runner: model" in log and "tensor-parallel rank 1 of 2 over gloo" in log  # the worker
        worker = httpx.get(base + "/health").json()["rank_pids"][0]
        lose_a_rank_under_16_streams(base, worker, signal.SIGKILL, random_llama)


def test_fdx_serve_refuses_shm_with_the_gpu_runner() -> None:
    import subprocess

    r = subprocess.run(serve_command("--model-runner", "gpu", "--device", "cpu", "-tp", "2", "--tp-backend", "shm",
                                     "--port", "1"), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--tp-backend shm: shared memory is the cpu runner's all-reduce" in r.stderr, r.stderr[-2000:]


def test_the_gloo_comm_takes_the_nccl_shape() -> None:
    """NcclComm is GlooComm with nccl's name, device variable and a device synchronize."""
    from fdx.parallel.gloo_comm import GlooComm, NcclComm, paddle_comm

    assert paddle_comm("nccl") is NcclComm and paddle_comm("gloo") is GlooComm
    assert NcclComm._device_env(3) == {"FLAGS_selected_gpus": "3"} and GlooComm._device_env(3) == {}
    assert NcclComm.backend == "nccl" and NcclComm.handle == 0
