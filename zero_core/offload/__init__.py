"""ZeRO-Offload and ZeRO-Infinity: optimizer states and parameters outside the device.

Where things are:

- errors.py — :class:`OffloadError` (every disk problem, naming the path and the fix);
- cleanup.py — the per-rank swap directory, removed at exit (also on exceptions and
  SIGTERM) and when a later run finds it left behind by a killed process;
- swap_file.py — one swap file: header (magic, dtype, length), aligned region reads and
  writes (``O_DIRECT`` where the file system has it), a CRC-32 per region verified on read;
- subgroups.py — plain functions: cutting a rank's partition into sub-groups and a
  sub-group into per-bucket pieces;
- host.py — :class:`HostStateStore`: master weights and optimizer states in (pinned)
  host memory (``offload_optimizer.device: cpu``);
- nvme.py — :class:`NvmeStateStore`: the same states in swap files, streamed through
  ``buffer_count`` sub-group buffers with read-ahead and write-behind worker threads;
- optimizer.py — :class:`OffloadedOptimizer`: the sub-grouped step on the CPU kernels,
  gradients streamed to the host and parameters streamed back; its builder picks the
  variants below;
- partial.py — ``offload_optimizer.ratio`` < 1 (ZeRO-Offload++): the first ``1 - ratio``
  of the sub-groups keep their states on the device and step there;
- speculative.py — ``offload_optimizer.super_offload`` (SuperOffload): host steps
  speculated per sub-group as the boundary backward reduces it, validated (kept, redone or rolled back) in
  ``step()``;
- zenflow.py — :class:`ZenFlowOptimizer` (``zero_optimization.zenflow``, stages 1-2): the
  top-k gradient columns stepped on the device every step, the rest accumulated and
  stepped on the host every ``update_interval`` steps (optionally on a worker thread);
  built by ``build_zenflow`` (engine/optimizer_choice.py decides which optimizer);
- zenflow_auto.py — ``update_interval: "auto"``: when the host update is due, from the
  gradients' mass (DeepSpeed's rule with ``auto_ratio``);
- zenflow_stage3.py — ZenFlow over stage 3's partitions (a small subclass);
- params.py — ``offload_param`` for stage 3: parameter partitions in host memory or in
  files, fetched per fetch unit (with read-ahead along the recorded order) in the
  stage-3 gather path.

How the engine uses it: ``ZeroEngine`` builds :class:`OffloadedOptimizer` instead of the
``PartitionedOptimizer`` when ``zero_optimization.offload_optimizer.device`` is not
``"none"``; stage 3's parts ask :func:`zero_core.offload.params.build_param_offload` for the
parameter store they hand to their group buffers, their gatherer (the partition source)
and, as ``StageParts.param_store``, the optimizer. Builders here get the engine's
``BuildContext``, never the engine; nothing here imports ``zero_core.stage3`` (the
contracts are in ``zero_core/interfaces/engine_parts.py``).
"""
from zero_core.offload.errors import OffloadError  # noqa: F401
