"""The update: which rule, over which partitions, with which scale and learning rate.

- rules.py — the update rule (Adam/AdamW/SGD…) from a config section or a torch optimizer,
  and the parameter groups;
- partitioned.py — :class:`PartitionedOptimizer`: the rule applied by the accelerator's
  fused kernel to this rank's fp32 partition, then the new values all-gathered (every stage);
- loss_scaler.py — fp16 static and dynamic loss scaling (DeepSpeed semantics);
- lr_schedules.py — DeepSpeed's learning-rate schedules.
- onebit.py — DeepSpeed's 1-bit Adam, 0/1 Adam and 1-bit LAMB (stage 0), over
  compressed_allreduce.py, the error-compensated 1-bit all-reduce.

ZeRO-Offload's optimizer (``zero_core/offload/optimizer.py``) subclasses the partitioned one.
"""
