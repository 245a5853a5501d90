"""Tensor parallelism: a model split across worker ranks (``--tensor-parallel-size``).

* :mod:`fdx.parallel.sharding` -- which slice of each weight a rank holds
  (Megatron's layout) and the checks that a model divides;
* :mod:`fdx.parallel.shm_comm` -- the collectives (all-reduce, gather)
  between the ranks of one host, over shared memory (fdx/csrc/tp_comm.cc);
* :mod:`fdx.parallel.group` -- the rank group: the worker processes that
  rank 0 (the engine's model runner) starts, feeds and controls;
* :mod:`fdx.parallel.worker` -- the worker process of ranks 1..N-1.

See docs/PARALLELISM.md.
"""
