"""zero-core: ZeRO (Zero Redundancy Optimizer) for PyTorch on any accelerator.

Public API (DeepSpeed-compatible names)::

    engine, optimizer, _, lr_scheduler = zero_core.initialize(model=model,
        model_parameters=model.parameters(), config=cfg)
"""
__version__ = "0.1.0"

from .runtime import get_runtime, init_distributed  # noqa: E402,F401
from .engine import ZeroEngine, initialize  # noqa: E402,F401
