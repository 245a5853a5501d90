"""Is the machine idle?  Benchmarks on shared cores are noisy, so every run
samples ``/proc/stat`` (and per-process CPU time) for about a second first
and records the answer next to its figures.

Invariant: never raises; on a system without ``/proc`` the answer is
``{"checked": False}``.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

#: busy fraction of all CPUs above which the machine is reported as not idle
BUSY_THRESHOLD = 0.15


def _cpu_times() -> tuple[int, int] | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            parts = f.readline().split()
    except OSError:
        return None
    vals = [int(x) for x in parts[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals[:8]), idle


def _proc_times() -> dict[int, tuple[str, int]]:
    out: dict[int, tuple[str, int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                s = f.read()
        except OSError:
            continue
        lp, rp = s.find("("), s.rfind(")")
        fields = s[rp + 2 :].split()
        try:
            out[pid] = (s[lp + 1 : rp], int(fields[11]) + int(fields[12]))
        except (IndexError, ValueError):
            continue
    return out


def idle_check(seconds: float = 1.0, exclude_pids: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Sample CPU use for ``seconds``; name the busiest processes."""
    a = _cpu_times()
    if a is None:
        return {"checked": False}
    pa = _proc_times()
    time.sleep(seconds)
    b = _cpu_times()
    pb = _proc_times()
    if b is None:
        return {"checked": False}
    total = max(b[0] - a[0], 1)
    busy = 1.0 - (b[1] - a[1]) / total
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    ncpu = os.cpu_count() or 1
    top = []
    for pid, (name, t) in pb.items():
        if pid in exclude_pids or pid == os.getpid() or pid not in pa:
            continue
        d = t - pa[pid][1]
        if d > 0:
            top.append((d / hz / seconds, pid, name))
    top.sort(reverse=True)
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            load1 = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        load1 = -1.0
    return {
        "checked": True,
        "idle": busy < BUSY_THRESHOLD,
        "busy_fraction": round(busy, 3),
        "seconds": seconds,
        "loadavg_1m": load1,
        "cpus": ncpu,
        "top_processes": [{"pid": p, "name": n, "cpu": round(c, 2)} for c, p, n in top[:3] if c >= 0.05],
    }


def describe_idle(info: dict[str, Any]) -> str:
    if not info.get("checked"):
        return "machine idle: unknown (no /proc)"
    word = "yes" if info["idle"] else "NO"
    line = (
        f"machine idle: {word} (CPU busy {info['busy_fraction'] * 100:.0f}% of {info['cpus']} cores "
        f"over {info['seconds']:.1f} s, loadavg {info['loadavg_1m']:.2f})"
    )
    if not info["idle"] and info.get("top_processes"):
        line += "; busiest: " + ", ".join(f"{p['name']}[{p['pid']}] {p['cpu'] * 100:.0f}%" for p in info["top_processes"])
    return line


def machine_info() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": model or platform.processor(),
        "cpus": os.cpu_count(),
        "memory_gib": round(mem / (1 << 30), 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _ppids() -> dict[int, int]:
    out: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", encoding="utf-8", errors="replace") as f:
                s = f.read()
            out[int(d)] = int(s[s.rfind(")") + 2 :].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def _tree(roots: frozenset[int], ppids: dict[int, int]) -> set[int]:
    tree = set(r for r in roots if r in ppids)
    changed = True
    while changed:
        changed = False
        for pid, ppid in ppids.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                changed = True
    return tree


class CpuSampler:
    """CPU used *during* a run by everything except the benchmark itself and
    the server's process tree (``server_pids``), in cores: the noise the run
    suffered on a shared machine.  Without ``server_pids`` only the total
    busy fraction is known."""

    def __init__(self, server_pids: frozenset[int] = frozenset()) -> None:
        self.server_pids = server_pids
        self._t0 = 0.0
        self._cpu0: tuple[int, int] | None = None
        self._p0: dict[int, tuple[str, int]] = {}

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._cpu0 = _cpu_times()
        self._p0 = _proc_times()

    def stop(self) -> dict[str, Any]:
        cpu1 = _cpu_times()
        if self._cpu0 is None or cpu1 is None:
            return {"checked": False}
        elapsed = max(time.monotonic() - self._t0, 1e-6)
        p1 = _proc_times()
        hz = os.sysconf("SC_CLK_TCK")
        ncpu = os.cpu_count() or 1
        total = max(cpu1[0] - self._cpu0[0], 1)
        busy_ticks = total - (cpu1[1] - self._cpu0[1])
        out: dict[str, Any] = {
            "checked": True,
            "seconds": round(elapsed, 2),
            "busy_fraction": round(busy_ticks / total, 3),
        }
        if self.server_pids:
            mine = _tree(self.server_pids, _ppids()) | {os.getpid()}
            own = 0
            for pid in mine:
                if pid in p1:
                    own += p1[pid][1] - (self._p0[pid][1] if pid in self._p0 else 0)
            # busy ticks are summed over all CPUs; process ticks are too
            others = max(busy_ticks - own, 0) / hz if hz else 0.0
            out["others_cores"] = round(others / elapsed, 2)
            out["server_cores"] = round(max(own, 0) / hz / elapsed, 2) if hz else 0.0
        out["cpus"] = ncpu
        return out
