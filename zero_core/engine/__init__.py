"""The engine room: the training step every ZeRO stage shares.

- core.py — :class:`ZeroEngine`: forward, backward (loss scaling), reports, checkpoint
  entry points, generation, handing the model back;
- update.py — the optimizer update (global norm, clipping, the non-finite skip, the loss
  scaler) decided on the device, and the host's books of it (LR schedule, counters,
  warnings) one step later, with no synchronization in between;
- contract.py — :class:`StageParts`: what a stage contributes (stage0to2/parts.py,
  stage3/parts.py) and the points where the engine calls it;
- step_stats.py — the step's one all-reduce (norm, overflow, equal batches), the
  error that names unequal batches, and the samples one forward call fed;
- timers.py — what rank 0 prints: ``steps_per_print``'s progress line and
  ``wall_clock_breakdown``'s per-phase times and bytes (``engine.wall_clock``);
- optimizer_choice.py — which optimizer the engine steps with (plain, offloaded, ZenFlow,
  1-bit, device step over offloaded parameters): the one decision;
- compile.py — ``engine.compile()``: torch.compile per block;
- model_sync.py — every rank starts from the same model (the stages' ``prepare_model``).
- autocast.py — ``torch_autocast``: the forward's autocast and, per parameter, the dtype its
  gradient is reduced in (``lower_precision_safe_modules``), read by the stages' reducers.

The stages sit above this folder and import it; nothing here imports a stage. Only
``zero_core/factory.py`` knows which stage's parts an engine gets.
"""
