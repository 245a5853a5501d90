#!/usr/bin/env python
"""Run a bench script with its wall clock replaced by process CPU time.

On a shared, loaded machine wall-clock figures swing with whatever else
runs; CPU time does not count the slices given to other processes.  Meant
with one thread (``OMP_NUM_THREADS=1``, set here unless given: with more, an
OpenMP thread spinning at a barrier would count too).  The script's
``time.perf_counter`` becomes ``time.process_time``; the figures are
compute speed on one core, comparable side by side, not serving speed.

    .venv/bin/python bench/cpu_clock.py bench/bench_model.py --no-peer --dtype int8
"""

from __future__ import annotations

import os
import runpy
import sys
import time

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    time.perf_counter = time.process_time
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
