"""zero-core: ZeRO (Zero Redundancy Optimizer) for PyTorch on any accelerator.

Public API (DeepSpeed-compatible names)::

    engine, optimizer, _, lr_scheduler = zero_core.initialize(model=model,
        model_parameters=model.parameters(), config=cfg)

    with zero_core.Init(config=cfg):          # ZeRO stage 3: build the model partitioned
        model = Model()
    with zero_core.GatheredParameters(params, modifier_rank=0):
        ...                                    # read/modify full parameters
"""
__version__ = "0.1.0"

from .runtime import get_runtime, init_distributed  # noqa: E402,F401
from .engine import ZeroEngine, initialize  # noqa: E402,F401
from .stage3 import (GatheredParameters, Init, ParameterNotGatheredError,  # noqa: E402,F401
                     register_external_parameter, unregister_external_parameter)
