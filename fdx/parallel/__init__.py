"""Tensor parallelism: a model split across worker ranks (``--tensor-parallel-size``).

* :mod:`fdx.parallel.sharding` -- which slice of each weight a rank holds
  (Megatron's layout) and the checks that a model divides;
* :mod:`fdx.parallel.shm_comm` -- the collectives (all-reduce, gather)
  between the ranks of one host, over shared memory (fdx/csrc/tp_comm.cc);
* :mod:`fdx.parallel.gloo_comm` -- the same collectives through Paddle's
  gloo, between ranks on any hosts;
* :mod:`fdx.parallel.group` -- the rank group: the worker processes that
  rank 0 (the engine's model runner) starts, feeds and controls;
* :mod:`fdx.parallel.worker` -- the worker process of ranks 1..N-1;
* :mod:`fdx.parallel.node` -- the agent that starts a host's ranks when the
  group spans ``--nnodes`` hosts.

See docs/PARALLELISM.md.
"""
