"""The node agent: what ``fdx serve --nnodes N --node-rank K`` (K > 0) runs on
a host that holds tensor-parallel ranks but no API server (the ``tp-node``
deployment, :mod:`fdx.plugins.deployments.tp_node`).

Loop: say hello to rank 0's control socket (``--master-addr``:``--master-port``)
until rank 0's group answers ``spawn`` (the group's id, size, backend and
store); start this node's ranks ``K*P .. K*P+P-1`` (``P`` = tp / nnodes) as
worker processes (:mod:`fdx.parallel.worker`), which join rank 0 themselves.
When any of them exits (a fault, rank 0's death, the group's stop), or the
connection to rank 0 drops (it died: a stopped rank here could not notice),
tell rank 0 (``exit``), end the others and say hello again: the supervisor's restart of
rank 0 is a restart of the whole group, on every node.  SIGTERM/SIGINT end
the ranks and the agent.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import threading
import uuid
from typing import Any

from fdx.parallel.group import RankLink

log = logging.getLogger("fdx.parallel")

#: seconds between hellos while no group holds this node's ranks
HELLO_INTERVAL = 0.5


def run_node_agent(config: Any) -> int:
    import zmq

    from fdx.logs import setup_logging

    setup_logging(config.log_level, process=f"tp node {config.node_rank}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    per = int(config.ranks_per_node)
    ranks = range(config.node_rank * per, (config.node_rank + 1) * per)
    threads = max(1, (config.num_threads or os.cpu_count() or 1) // per)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, f"node{config.node_rank}-{uuid.uuid4().hex[:8]}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # no hello queues up while rank 0 is away
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # a vanished rank 0 host drops the connection too
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    gone = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    addr = f"tcp://{config.master_addr}:{config.master_port}"
    sock.connect(addr)
    log.info("node %d of %d: ranks %d..%d (%d threads each) wait for rank 0 at %s", config.node_rank,
             config.nnodes, ranks[0], ranks[-1], threads, addr)

    def tell(msg: tuple[Any, ...]) -> None:
        try:
            sock.send(pickle.dumps(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    procs: dict[int, subprocess.Popen[bytes]] = {}
    group = ""
    try:
        while not stop.is_set():
            if not procs:
                tell(("hello", config.node_rank, None))
            if sock.poll(int(HELLO_INTERVAL * 1000)):
                kind, info = pickle.loads(sock.recv())
                if kind == "spawn" and not procs:
                    group = info["group_id"]
                    for r in ranks:
                        procs[r] = RankLink(**{**info, "rank": r, "threads": threads}).spawn()
                    log.info("group %s: started ranks %s (pids %s)", group, list(procs),
                             " ".join(str(p.pid) for p in procs.values()))
            lost = False
            while gone.poll(0):  # every queued event: an old one must not end the next group's ranks
                gone.recv_multipart()
                lost = True
            if lost:
                if procs:  # rank 0 is gone: its group is over, even for a rank that cannot notice (stopped)
                    log.warning("group %s: rank 0's connection dropped; ending this node's ranks", group)
                    tell(("exit", next(iter(procs)), (group, "ended: rank 0's connection dropped")))
                    _end(procs)
                    procs = {}
                    continue
            dead = {r: p.poll() for r, p in procs.items() if p.poll() is not None}
            if dead:
                r, rc = next(iter(dead.items()))
                log.log(logging.INFO if rc == 0 else logging.WARNING, "group %s: rank %d exited with status %s; "
                        "ending this node's ranks and waiting for rank 0's next group", group, r, rc)
                tell(("exit", r, (group, rc)))
                _end(procs)
                procs = {}
    finally:
        _end(procs)
        gone.close(0)
        sock.close(0)
    return 0


def _end(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.kill()
    for p in procs.values():
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass

