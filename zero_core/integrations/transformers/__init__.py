"""Hugging Face Transformers on the zero-core engine (``pip install 'zero-core[transformers]'``).

- ``ZeroCoreTrainer`` (trainer.py): a ``transformers.Trainer`` whose training runs on the
  engine, configured by ``zero_config=``.
- ``fill_auto_values`` (auto_values.py): HF's ``"auto"`` config values filled from
  ``TrainingArguments`` and the model, as HF fills them for DeepSpeed.
- ``from_pretrained`` / ``save_pretrained`` (pretrained.py): a local safetensors checkpoint
  loaded straight into stage-3 partitions, and HF's sharded layout written from them.

Names are resolved on first use, so that importing one part does not import the others.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "ZeroCoreTrainer": "trainer",
    "fill_auto_values": "auto_values",
    "from_pretrained": "pretrained",
    "save_pretrained": "pretrained",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
