"""zero-core: ZeRO (Zero Redundancy Optimizer) for PyTorch on any accelerator.

Public API (DeepSpeed-compatible names)::

    engine, optimizer, _, lr_scheduler = zero_core.initialize(model=model,
        model_parameters=model.parameters(), config=cfg)

    with zero_core.Init(config=cfg):          # ZeRO stage 3: build the model partitioned
        model = Model()
    with zero_core.GatheredParameters(params, modifier_rank=0):
        ...                                    # read/modify full parameters

Errors zero-core raises on purpose derive from ``zero_core.ZeroCoreError`` (config problems:
``ConfigError``; ``NonFiniteGradientError``, ``RankDisagreementError``,
``GenerationDivergedError``).

Generation inside training loops (RLHF, GRPO): ``engine.generate(...)`` and
``zero_core.gathered_for_generation(engine)`` (docs/GENERATION.md).
"""
from zero_core.version import __version__  # noqa: F401
# an unsupported torch is refused here, by name, before any module uses its APIs
from zero_core.runtime.torch_support import check_torch as _check_torch  # noqa: E402

_check_torch()

import sys as _sys  # noqa: E402

from zero_core.activation import checkpointing  # noqa: E402,F401
from zero_core.errors import ConfigError, ZeroCoreError  # noqa: E402,F401
from zero_core.optim.nonfinite import NonFiniteGradientError  # noqa: E402,F401
from zero_core.runtime.agreement import RankDisagreementError  # noqa: E402,F401
from zero_core.factory import initialize  # noqa: E402,F401
from zero_core.generation.generate import gathered_for_generation  # noqa: E402,F401
from zero_core.stage3.generation_cache import GenerationDivergedError  # noqa: E402,F401
from zero_core.runtime.context import get_runtime, init_distributed  # noqa: E402,F401
from zero_core.engine.core import ZeroEngine  # noqa: E402,F401
from zero_core.stage3 import (GatheredParameters, Init, ParameterNotGatheredError,  # noqa: E402,F401
                              register_external_parameter, unregister_external_parameter)

# ``zero_core.checkpointing`` is DeepSpeed's ``deepspeed.checkpointing``: public under that
# name, implemented in activation/ with the rest of ZeRO-R. Registered so that
# ``import zero_core.checkpointing`` finds the same module object (one state, one API).
_sys.modules[__name__ + ".checkpointing"] = checkpointing
