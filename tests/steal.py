"""Time the hypervisor took from this machine's vCPUs, for tests that bound latency.

The project's machines are VMs with 2 vCPUs.  When both are busy (an engine's
two OpenMP threads, the API process, the test's client), the host takes a
vCPU away for about 100 ms at a time (``/proc/stat``'s ``steal`` column jumps
by 10 ticks at once; two busy loops alone see it ~5 times in 10 s).  A
parallel region that has a thread on that vCPU waits for it, so an engine
step takes ~120 ms instead of ~18: a stall no code in fdx can cause or avoid.

:class:`StealSampler` reads the counter every few milliseconds in a thread
and keeps each jump with its time, so a test can subtract the stolen time
that falls inside an interval it measured (:meth:`StealSampler.stolen`)
instead of failing on the host's scheduling.
"""

from __future__ import annotations

import os
import threading
import time

#: how often the counter is read (a jump is seen at most this much after the vCPU is back)
PERIOD = 0.005
#: USER_HZ: /proc/stat counts in these ticks per second
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def steal_ticks() -> dict[str, int]:
    """Each vCPU's steal time so far, in ticks (empty where /proc/stat has no such column)."""
    out = {}
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0].startswith("cpu") and fields[0] != "cpu" and len(fields) > 8:
                    out[fields[0]] = int(fields[8])
    except OSError:
        pass
    return out


class StealSampler:
    """``with StealSampler() as s: ...`` then ``s.stolen(a, b)``: seconds of
    steal seen in ``[a, b]`` (``time.monotonic`` times).  A jump is seen after
    the stolen time ends, so it is counted for an interval that ends up to
    ``slack`` seconds before the jump was seen."""

    def __init__(self) -> None:
        self.jumps: list[tuple[float, str, float]] = []  # (monotonic time seen, vCPU, seconds stolen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steal-sampler", daemon=True)

    def _run(self) -> None:
        last = steal_ticks()
        while not self._stop.wait(PERIOD):
            now = steal_ticks()
            seen = time.monotonic()
            for cpu, ticks in now.items():
                if ticks != last.get(cpu, ticks):
                    self.jumps.append((seen, cpu, (ticks - last[cpu]) / TICKS))
            last = now

    def __enter__(self) -> StealSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def stolen(self, start: float, end: float, slack: float = 0.05) -> float:
        """Seconds stolen from the vCPU that lost the most, by jumps seen in
        ``[start, end + slack]`` (the wall time a step on every vCPU lost)."""
        per_cpu: dict[str, float] = {}
        for t, cpu, s in self.jumps:
            if start <= t <= end + slack:
                per_cpu[cpu] = per_cpu.get(cpu, 0.0) + s
        return max(per_cpu.values(), default=0.0)
