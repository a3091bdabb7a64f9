"""Start-up: who this process is and which backends it runs on.

- launch.py — rank, world size and launcher (mpirun, torchrun, Slurm, single process);
- topology.py — which ranks share a node (the intra-/inter-node split of ZeRO++);
- (torch.distributed's start-up and rendezvous belong to the torch.distributed backends,
  ``backends/comm/torch_dist_init.py``);
- registry.py — the one pluggy registry: finds accelerators, communicators, kernel sets;
- context.py — :class:`Runtime`, the process-wide choice of accelerator, communicator and
  kernels (``zero_core.init_distributed`` / ``get_runtime``).

This package's ``__init__`` imports nothing, so importing one of its value types (launch
info, topology) does not start the registry.
"""
