"""The contracts between the engine and the hardware: what a backend implements.

Arrows point here from both sides — the engine (stages, optimizer, checkpoints) calls these
interfaces, and the backends in ``zero_core.backends`` implement them — and nothing here
imports either side. A plugin author needs only this folder and ``zero_core.errors``.

- accelerator.py — :class:`Accelerator`: the ~20 things the engine needs from a device;
- communicator.py — :class:`Communicator`: the collectives ZeRO needs, on flat tensors,
  with the ledger, the timeout, groups and the intra/inter-node split;
- staging.py — collectives on tensors the communicator cannot reach (device <-> host);
- ledger.py — :class:`CommLedger`: the bytes a rank really sent, by operation and link;
- kernels.py — :class:`KernelSet`: the fused optimizer and quantization kernels;
- hookspecs.py — the pluggy hooks a plugin implements to offer all of the above.
"""
