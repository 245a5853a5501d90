"""A tensor-parallel worker: ranks 1..N-1 (``python -m fdx.parallel.worker``,
started by :class:`fdx.parallel.group.RankGroup`).

It builds the same model runner as rank 0 (the config's: ``cpu`` or
``gpu``, :data:`RUNNERS`), holding its own shard, on its own device where
the device is an accelerator (:func:`rank_device`: ``gpu:base+r`` for the
node's ``r``-th rank), then obeys rank 0's messages in order:

* ``("step", layout)``: the same forward as rank 0 (the collectives keep the
  ranks in lock step; its logits stay with rank 0);
* ``("call", method, args)``: run ``runner.<method>(*args)`` and reply
  ``("result", rank, value)`` or ``("error", rank, message)``;
* ``("cast", method, args)``: the same without a reply (a beam's KV block
  copies before a step);
* ``("stop",)``: exit.

A failing step breaks the group (every rank's collective then fails at
once) and ends the worker: rank 0 restarts the group.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import traceback
from typing import Any

from fdx.parallel.group import RankLink, die_with_parent

#: runner methods rank 0 may call on a worker
CALLS = frozenset({"release", "restore", "load_weights", "read_kv_blocks", "write_kv_blocks", "copy_kv_blocks"})
#: the model runners that split (``--model-runner`` name -> module, class)
RUNNERS = {"cpu": ("fdx.model.runner", "PaddleModelRunner"), "gpu": ("fdx.model.gpu_runner", "GPUModelRunner")}


def rank_device(plugins: Any, config: Any, rank: int) -> Any:
    """Rank ``rank``'s device: the config's; an accelerator's (a device with
    an index) at ``index + rank % ranks_per_node`` -- one device per rank of a node."""
    from fdx.config import split_device

    name, index = split_device(config.device)
    device = plugins.create("device", name)
    if hasattr(device, "index"):
        device = plugins.create("device", name, index=(index or 0) + rank % config.ranks_per_node)
    return device


def build_runner(config: Any, link: RankLink, on_layer: Any) -> Any:
    """The config's model runner, as worker rank ``link.rank``."""
    import importlib

    from fdx.core.plugins import get_plugins

    plugins = get_plugins(config.disable_plugins)
    device = rank_device(plugins, config, link.rank)
    name = config.model_runner or device.default_runner
    if name not in RUNNERS:
        raise ValueError(f"the {name} model runner cannot split (tensor-parallel runners: {', '.join(RUNNERS)})")
    device.configure_env(link.threads)
    module, cls = RUNNERS[name]
    return getattr(importlib.import_module(module), cls)(config, device, link=link, on_layer=on_layer)


def main(argv: list[str]) -> int:
    die_with_parent()
    link = RankLink.from_argv(argv)
    os.environ["OMP_NUM_THREADS"] = str(link.threads)  # before Paddle is imported
    import zmq

    ctx = zmq.Context.instance()
    cmd = ctx.socket(zmq.DEALER)  # to and from rank 0's ROUTER
    cmd.setsockopt(zmq.ROUTING_ID, f"{link.group_id}:{link.rank}".encode())
    cmd.setsockopt(zmq.LINGER, 1000)
    cmd.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # another host's rank 0 that vanished drops the connection
    cmd.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    cmd.setsockopt(zmq.RECONNECT_IVL, -1)  # rank 0 once gone never comes back: its restart is a new group
    gone = cmd.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    cmd.connect(link.ctrl_addr)
    poller = zmq.Poller()
    poller.register(cmd, zmq.POLLIN)
    poller.register(gone, zmq.POLLIN)

    def send(kind: str, payload: Any) -> None:
        cmd.send(pickle.dumps((kind, link.rank, payload), protocol=pickle.HIGHEST_PROTOCOL))

    def recv() -> Any:
        """Rank 0's next message; exit if its connection dropped (it died)."""
        while True:
            ready = dict(poller.poll())
            if cmd in ready:  # what rank 0 sent before it went (a stop) comes first
                return pickle.loads(cmd.recv())
            if gone in ready:
                logging.getLogger("fdx.parallel").warning("tp rank %d: rank 0's control connection dropped; "
                                                          "exiting", link.rank)
                os._exit(1)

    send("join", (link.group_id, os.getpid()))
    kind, config = recv()
    assert kind == "init", kind
    logging.basicConfig(level=getattr(logging, str(config.log_level).upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {link.rank}] %(message)s")
    try:
        runner = build_runner(config, link, lambda: send("progress", 1))
    except Exception as exc:  # noqa: BLE001 - rank 0 reports it, naming this rank
        send("error", f"{type(exc).__name__}: {exc}")
        logging.getLogger("fdx.parallel").error("start-up failed:\n%s", traceback.format_exc())
        return 1
    send("ready", None)
    comm = runner.comm
    while True:
        msg = recv()
        kind = msg[0]
        if kind == "stop":
            return 0
        try:
            if kind == "step":
                runner.forward_shard(msg[1])
            elif kind in ("call", "cast") and msg[1] in CALLS:
                value = getattr(runner, msg[1])(*msg[2])
                if kind == "call":
                    send("result", value)
            else:
                raise ValueError(f"unknown message {kind!r}")
        except Exception as exc:  # noqa: BLE001
            if kind == "call":
                send("error", f"{type(exc).__name__}: {exc}")
                continue
            logging.getLogger("fdx.parallel").error("%s failed; breaking the group:\n%s", kind,
                                                    traceback.format_exc())
            comm.abort()
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
