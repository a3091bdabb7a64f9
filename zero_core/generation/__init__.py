"""Generation inside training loops (RLHF, GRPO): the policy generates, then trains.

- generate.py: ``engine.generate`` (DeepSpeed's hybrid engine: the ``hybrid_engine``
  section decides how stage 3 gathers for the call, and when the copies are released) and
  ``zero_core.gathered_for_generation`` (the whole model gathered once, the engine's hooks
  off, for user code that calls ``model.generate`` itself, as TRL's
  ``unwrap_model_for_generation`` does).
- The stage-3 rule that keeps units gathered between decode steps within a budget lives
  with the other gather decisions: zero_core/stage3/generation_cache.py.

docs/GENERATION.md is the user's guide; docs/ARCHITECTURE.md §11 the design.
"""
