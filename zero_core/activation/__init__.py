"""ZeRO-R activation checkpointing (public as ``zero_core.checkpointing``).

- checkpointing.py — the DeepSpeed-compatible API (``configure``, ``checkpoint``, …) and the
  autograd function that stores and recomputes;
- partition.py — the model-parallel group checkpointed activations are partitioned across;
- layout.py — byte layout of the stored inputs (partitioned across that group);
- buffers.py — contiguous, reused buffers for the stored activations (defragmentation);
- rng.py — random-number and autocast state, replayed at recomputation.
"""
