"""The update: which rule, over which partitions, with which scale and learning rate.

- rules.py — the update rule (Adam/AdamW/SGD…) from a config section or a torch optimizer,
  and the parameter groups;
- partitioned.py — :class:`PartitionedOptimizer`: the rule applied by the accelerator's
  fused kernel to this rank's fp32 partition, then the new values all-gathered (every stage);
- loss_scaler.py — fp16 static and dynamic loss scaling (DeepSpeed semantics);
- lr_schedules.py — DeepSpeed's learning-rate schedules.

ZeRO-Offload's optimizer (``zero_core/offload/optimizer.py``) subclasses the partitioned one.
"""
