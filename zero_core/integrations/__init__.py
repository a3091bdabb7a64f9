"""Where users already train: the training frameworks zero-core plugs into.

Each module imports its framework, which stays an optional extra (the core install does
not grow; ``tests/test_integrations_optional.py`` checks it):

- ``lightning.py`` — ``ZeroCoreStrategy``, a PyTorch Lightning ``Strategy``
  (``pip install 'zero-core[lightning]'``). Importing it registers
  ``Trainer(strategy="zero_core" | "zero_core_stage_2" | "zero_core_stage_3")``.
- ``transformers/`` — Hugging Face Transformers (``pip install 'zero-core[transformers]'``):
  ``ZeroCoreTrainer`` (trainer.py), HF's ``"auto"`` config values (auto_values.py), and
  pretrained weights straight into stage-3 partitions and back (pretrained.py).

The engine never imports this folder (ARCHITECTURE §1): integrations sit on top of the
public API, as a user's own code would.
"""
