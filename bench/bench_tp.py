"""Tensor parallelism against one rank and against dp, side by side.

    .venv/bin/python bench/bench_tp.py [--dtype float32] [--concurrency 1,16] [--num-prompts 32] \
        [--num-prompts-c1 8] [--input-len 128] [--output-len 64] [--repeat 1] [--allreduce-only] [--gloo]

1. **All-reduce latency per backend**, 2 ranks, 2,304 floats (one decode
   row of a 576-wide model, 4 rows) and 576 x 64 floats (a prefill chunk):
   fdx's ``shm`` (fdx/csrc/tp_comm.cc) and ``gloo``
   (fdx/parallel/gloo_comm.py: ``paddle.distributed.all_reduce`` after
   ``init_parallel_env`` with ``PADDLE_DISTRI_BACKEND=gloo``, the backend of
   ranks across hosts), each rank a process; and the gloo group's join time.
2. **Serving**: a random-weight llama of SmolLM2-135M's shape (30 layers,
   hidden 576, MLP 1,536, vocabulary 49,152) but with 8 query and 4 KV heads
   so that it divides by 2, written once under ``~/.cache/fdx/bench-models``.
   Servers, started one after another and then measured in turn
   (alternating order over ``--repeat``):

   * ``TP=1 x1``: one rank, ``--num-threads 1``;
   * ``TP=1 x2``: one rank, 2 threads;
   * ``TP=2 x1``: two ranks, 1 thread each (``--num-threads 2``);
   * ``dp=2 x1``: two replicas, 1 thread each;
   * with ``--gloo``, ``TP=2 gloo x1``: TP=2 x1 over the gloo backend (what
     ranks across hosts use, here on one host).

   Per concurrency: output tok/s and TTFT p50 of each, and the ratios
   against ``TP=1 x2`` (and ``TP=2 x1 / TP=1 x1`` at c=1: the scaling).

3. **``--engine``**: the model runner alone, driven step by step in one
   process per config (no API process, no scheduler): one stream's median
   decode step for ``TP=1 x1``, ``TP=1 x2`` and ``TP=2 x1``.  Against the
   served rows it shows what the server around the engine costs.

4. **``--moe``**: the same four rows on a random Qwen3-MoE (12 layers,
   hidden 512, 8 and 4 heads, 8 experts of width 512, top-2, vocabulary
   49,152), with dp replaced by ``EP=2 x1``: two ranks with
   ``--enable-expert-parallel`` (each 4 whole experts); ``TP=2 x1`` then
   splits every expert's width instead.

Timings on a shared machine are noisy: read the ratios, on an idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dp import run_point, server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests" / "data" / "arch" / "llama3"


def write_tokenizer(folder: Path) -> None:
    """SmolLM2's own tokenizer (49,152 tokens, from the embedded GGUF) as
    ``tokenizer.json`` + ``tokenizer_config.json``: the bench models share its
    vocabulary size, so every sampled token detokenizes to text as a real
    model's does (a test tokenizer of 512 tokens leaves most of them without
    text, which skews TTFT and the API process's work)."""
    from fdx.model.loader import load_tokenizer

    tok = load_tokenizer(None)
    (folder / "tokenizer.json").write_text(tok.to_json())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
         "add_bos_token": tok.add_bos_token}))

CONFIGS = {
    "TP=1 x1": ("--num-threads", "1"),
    "TP=1 x2": ("--num-threads", "2"),
    "TP=2 x1": ("--tensor-parallel-size", "2", "--num-threads", "2"),
    "dp=2 x1": ("--scheduler", "dp", "--data-parallel-size", "2", "--num-threads", "1"),
}
BASELINE = "TP=1 x2"
#: ``--moe``: dp's row becomes expert parallelism's
MOE_CONFIGS = {**{k: v for k, v in CONFIGS.items() if not k.startswith("dp")},
               "EP=2 x1": ("--tensor-parallel-size", "2", "--enable-expert-parallel", "--num-threads", "2")}


def bench_model() -> str:
    """The random 8-head SmolLM2-shaped llama (HF folder), written once."""
    from fdx.model.native import cache_dir

    d = Path(cache_dir()) / "bench-models" / "llama-576-h8kv4-L30-smollm2-tokenizer"
    if (d / "model.safetensors").exists():
        return str(d)
    from safetensors.numpy import save_file

    tmp = Path(tempfile.mkdtemp(dir=d.parent if d.parent.exists() else None))
    cfg = json.loads((TOKENIZER / "config.json").read_text())
    cfg.update(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
               num_key_value_heads=4, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
               max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    cfg.pop("rope_scaling", None)
    (tmp / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(tmp)
    rng = np.random.default_rng(0)
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((49152, 576), np.float32),
                                "model.norm.weight": np.ones(576, np.float32)}
    shapes = {"self_attn.q_proj": (512, 576), "self_attn.k_proj": (256, 576), "self_attn.v_proj": (256, 576),
              "self_attn.o_proj": (576, 512), "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576),
              "mlp.down_proj": (576, 1536)}
    for i in range(30):
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}.weight"] = rng.standard_normal(shape, np.float32) / np.sqrt(shape[1])
        w[f"model.layers.{i}.input_layernorm.weight"] = np.ones(576, np.float32)
        w[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(576, np.float32)
    save_file(w, str(tmp / "model.safetensors"))
    d.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, d)
    return str(d)


def bench_moe_model() -> str:
    """A random Qwen3-MoE (HF folder, SmolLM2's tokenizer), written once."""
    from fdx.model.native import cache_dir

    d = Path(cache_dir()) / "bench-models" / "qwen3moe-512-h8kv4-L12-e8x512-smollm2-tokenizer"
    if (d / "model.safetensors").exists():
        return str(d)
    from safetensors.numpy import save_file

    H, L, E, F, V = 512, 12, 8, 512, 49152
    tmp = Path(tempfile.mkdtemp(dir=d.parent if d.parent.exists() else None))
    cfg = json.loads((ROOT / "tests" / "data" / "arch" / "qwen3_moe" / "config.json").read_text())
    cfg.update(hidden_size=H, num_hidden_layers=L, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
               num_local_experts=E, moe_intermediate_size=F, intermediate_size=F, vocab_size=V,
               tie_word_embeddings=True, max_position_embeddings=4096)
    (tmp / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(tmp)
    rng = np.random.default_rng(0)
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((V, H), np.float32),
                                "model.norm.weight": np.ones(H, np.float32)}
    shapes = {"self_attn.q_proj": (512, H), "self_attn.k_proj": (256, H), "self_attn.v_proj": (256, H),
              "self_attn.o_proj": (H, 512), "mlp.gate": (E, H),
              **{f"mlp.experts.{e}.{n}": s for e in range(E)
                 for n, s in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F)))}}
    for i in range(L):
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}.weight"] = rng.standard_normal(shape, np.float32) / np.sqrt(shape[1])
        for name, n in (("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.q_norm", 64),
                        ("self_attn.k_norm", 64)):
            w[f"model.layers.{i}.{name}.weight"] = np.ones(n, np.float32)
    save_file(w, str(tmp / "model.safetensors"))
    d.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, d)
    return str(d)


# ---------------------------------------------------------------- all-reduce latency

_WORKER = r"""
import os, sys, time, numpy as np
backend, rank, n, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
x = np.ones(n, np.float32)
if backend == "shm":
    from fdx.parallel.shm_comm import ShmComm
    t0 = time.perf_counter()
    comm = ShmComm.attach(sys.argv[5], rank, 2, 1 << 20, 30.0)
    op = comm.all_reduce_numpy
else:  # fdx's gloo backend, as a rank runs it (paddle.distributed, the watchdog armed)
    import paddle
    from fdx.parallel.gloo_comm import GlooComm
    t0 = time.perf_counter()  # Paddle imported: the join alone
    comm = GlooComm.join(rank, 2, sys.argv[5], 30.0)
    t = paddle.to_tensor(x)
    def op(_):
        comm.all_reduce(t)
init = time.perf_counter() - t0
for _ in range(20):
    op(x)
t0 = time.perf_counter()
for _ in range(iters):
    op(x)
dt = (time.perf_counter() - t0) / iters
if rank == 0:
    print(dt * 1e6, init)
"""


# ---------------------------------------------------------------- the engine alone

_ENGINE = r"""
import json, os, statistics, sys, time
import numpy as np
model, dtype, tp, threads, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
from fdx.config import make_config
from fdx.core.interfaces import ScheduledBatch, ScheduledSeq
from fdx.core.messages import SamplingParams
from fdx.core.plugins import get_plugins
from fdx.core.request import Request
from fdx.model.runner import PaddleModelRunner
cfg = make_config(model=model, dtype=dtype, tensor_parallel_size=tp, num_threads=threads * tp, num_kv_blocks=64,
                  max_model_len=1024)
dev = get_plugins(()).create("device", "cpu")
dev.configure_env(threads)
r = PaddleModelRunner(cfg, dev)
prompt = [int(t) for t in np.random.default_rng(0).integers(600, 40000, 128)]
req = Request("a", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
              eos_token_ids=r.eos_token_ids, max_model_len=r.max_model_len)
req.block_ids = list(range(-(-(len(prompt) + n) // r.block_size)))
times = []
while req.finish_reason is None:
    s = ScheduledSeq(req, req.num_tokens - req.num_computed_tokens)
    t0 = time.perf_counter()
    out = r.execute(ScheduledBatch([s]))
    times.append(time.perf_counter() - t0)
    req.num_computed_tokens += s.num_new_tokens
    req.finish_reason = req.append_token(int(out.token_ids[0])) or None
print(json.dumps({"prefill_ms": times[0] * 1e3, "decode_ms": statistics.median(times[8:]) * 1e3}))
os._exit(0)
"""

#: ``--engine``: (ranks, threads a rank) of each row
ENGINE_CONFIGS = {"TP=1 x1": (1, 1), "TP=1 x2": (1, 2), "TP=2 x1": (2, 1)}


def engine_rows(model: str, opts: argparse.Namespace) -> int:
    """The model runner driven directly (no API process, no scheduler): one
    stream's median decode step of each config, each in its own process."""
    print(f"the engine alone ({opts.dtype}, a 128-token prompt, {opts.output_len} greedy tokens, "
          f"median decode step over {opts.repeat} alternating rounds):")
    got: dict[str, list[float]] = {}
    for rep in range(opts.repeat):
        for name, (tp, threads) in ENGINE_CONFIGS.items() if rep % 2 == 0 else reversed(ENGINE_CONFIGS.items()):
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            out = subprocess.run([sys.executable, "-c", _ENGINE, model, opts.dtype, str(tp), str(threads),
                                  str(opts.output_len)], env=env, capture_output=True, text=True, timeout=600)
            if out.returncode:
                raise RuntimeError(f"{name}: {out.stderr[-800:]}")
            got.setdefault(name, []).append(json.loads(out.stdout.strip().splitlines()[-1])["decode_ms"])
    ms = {k: statistics.median(v) for k, v in got.items()}
    for name, m in ms.items():
        print(f"  {name:8} {m:6.2f} ms a step  {1e3 / m:7.1f} tok/s  ({ms['TP=1 x1'] / m:4.2f}x TP=1 x1, "
              f"{ms['TP=1 x2'] / m:4.2f}x TP=1 x2)")
    print(f"load average: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    return 0


def allreduce_us(backend: str, n: int, iters: int) -> tuple[float, float]:
    """Microseconds per all-reduce of ``n`` floats between 2 ranks, and rank 0's seconds to join the group."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    extra: list[str] = []
    keep: Any = None
    if backend == "shm":
        from fdx.parallel.shm_comm import ShmComm

        keep = ShmComm.create(2, 30.0)
        extra = [keep.name]
    else:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            extra = [f"127.0.0.1:{s.getsockname()[1]}"]  # the group's TCP store
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, backend, str(r), str(n), str(iters), *extra],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    if keep is not None:
        keep.unlink()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{backend} all-reduce bench failed: {outs[0][1][-800:]} {outs[1][1][-800:]}")
    us, init = outs[0][0].strip().splitlines()[-1].split()
    return float(us), float(init)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--num-prompts-c1", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allreduce-only", action="store_true")
    p.add_argument("--gloo", action="store_true", help="also serve TP=2 over the gloo backend (TP=2 gloo x1)")
    p.add_argument("--moe", action="store_true", help="a random Qwen3-MoE; expert parallelism in dp's place")
    p.add_argument("--engine", action="store_true",
                   help="only the model runner driven directly, one stream, per config (no server)")
    opts = p.parse_args()
    configs = dict(CONFIGS)
    if opts.gloo:
        configs["TP=2 gloo x1"] = (*CONFIGS["TP=2 x1"], "--tp-backend", "gloo")

    if opts.moe:
        return serve_rows(bench_moe_model(), MOE_CONFIGS, opts)
    if opts.engine:
        return engine_rows(bench_model(), opts)
    print("all-reduce, 2 ranks (one process each, 1 thread), microseconds per call:")
    for n, iters in ((2304, 2000), (576 * 64, 500)):
        shm, _ = allreduce_us("shm", n, iters)
        try:
            gloo, init = allreduce_us("gloo", n, max(50, iters // 10))
            print(f"  {n:>6} floats: shm {shm:8.1f}   gloo {gloo:8.1f}   gloo / shm {gloo / shm:6.1f}x   "
                  f"(gloo group joined in {init:.1f} s)")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"  {n:>6} floats: shm {shm:8.1f}   gloo failed ({str(exc)[:200]})")
    if opts.allreduce_only:
        return 0

    return serve_rows(bench_model(), configs, opts)


def serve_rows(model: str, configs: dict[str, tuple[str, ...]], opts: argparse.Namespace) -> int:
    """Serve ``model`` under each of ``configs`` and print the table."""
    common = ("--model", model, "--dtype", opts.dtype)
    concs = [int(c) for c in opts.concurrency.split(",")]
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(server((*common, *args))) for name, args in configs.items()}
        names = list(configs)
        for conc in concs:
            n = opts.num_prompts_c1 if conc == 1 else opts.num_prompts
            for rep in range(opts.repeat):
                for name in names if rep % 2 == 0 else names[::-1]:
                    base, pid = servers[name]
                    run = run_point(base, pid, conc, n, opts, name)
                    run["loadavg"] = os.getloadavg()[0]
                    results.setdefault((name, conc), []).append(run)

    def med(name: str, conc: int, key: str) -> float:
        return statistics.median(r[key] for r in results[(name, conc)])

    print(f"\n{opts.dtype}, {opts.input_len}-token random prompts, {opts.output_len} output tokens; "
          f"ratio = row / {BASELINE}")
    for conc in concs:
        print(f"c={conc}:")
        for name in names:
            tps, ttft = med(name, conc, "output_throughput"), med(name, conc, "p50_ttft_ms")
            r1 = tps / med(BASELINE, conc, "output_throughput")
            r2 = ttft / med(BASELINE, conc, "p50_ttft_ms")
            print(f"  {name:12} {tps:8.1f} tok/s ({r1:5.2f}x)   TTFT p50 {ttft:8.1f} ms ({r2:5.2f}x)")
        if conc == 1:
            s = med("TP=2 x1", 1, "output_throughput") / med("TP=1 x1", 1, "output_throughput")
            print(f"  scaling at 1 thread a rank: TP=2 x1 / TP=1 x1 = {s:.2f}x (target >= 1.5)")
            if "EP=2 x1" in names:
                s = med("EP=2 x1", 1, "output_throughput") / med("TP=1 x1", 1, "output_throughput")
                print(f"  expert parallel: EP=2 x1 / TP=1 x1 = {s:.2f}x")
    loads = [r["loadavg"] for rs in results.values() for r in rs]
    print(f"load average after the runs: {min(loads):.1f}-{max(loads):.1f} ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
