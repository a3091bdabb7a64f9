"""ZeRO stages 0, 1 and 2: flat buffers per parameter group, reduced bucket by bucket.

Stage 0 is plain data parallelism on the same machinery (no partitioning); stage 1
partitions the optimizer states, stage 2 the gradients too. Mirrors ``stage3/``:

- buffers.py — :class:`GroupBuffers`: a group's flat parameter/gradient/master buffers and
  which slice of them this rank owns at each stage;
- grad_reduce.py — :class:`GradReducer`: backward hooks reduce each full bucket
  (all-reduce at stages 0-1, reduce-scatter at stage 2), overlapping the backward pass;
- parts.py — :class:`Stage0to2Parts`: these parts as the engine's StageParts
  (zero_core/engine/contract.py); the training step itself is zero_core/engine/core.py.

The optimizer over the partitions is shared by every stage and lives in ``zero_core/optim``.
"""
