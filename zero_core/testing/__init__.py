"""What zero-core ships for testing itself and the code built on it; nothing here is used
by training, and nothing of the engine imports it except the plan's rate measurement
(``zero_core.plan.measure`` and its worker) and the CLI, which launch ranks with it.

- :mod:`zero_core.testing.ranks` -- the one launcher of multi-rank jobs, ``run_ranks``
  (mpirun or torchrun-style, on this machine or ``cluster=`` an emulated cluster), and what
  a rank calls: ``report`` (hand a result back), ``leave_rank``;
- :mod:`zero_core.testing.emulated_cluster` -- ``EmulatedCluster``: two network namespaces
  joined by a rate-limited veth, a placement for ``run_ranks``; its command line is
  ``python -m zero_core.testing.emulated_cluster check|run|hold|cleanup``;
- :mod:`zero_core.testing.netns` -- the cluster's ``ip`` / ``tc`` plumbing (rates, shaping,
  finding and removing leftovers, the per-prefix lock);
- :mod:`zero_core.testing.device_audit` -- where an engine's tensors live (device or host
  memory), judged against what their owners declare; the device test matrix fails on any
  misplaced tensor;
- :mod:`zero_core.testing.elastic` -- jobs under torchrun's elastic agent and the faults
  injected into them (SIGKILL of a rank or of a node's whole process tree).

The package is empty on purpose: import the module you need.
"""
