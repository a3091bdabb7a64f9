"""The one dtype table: the config's short names ("fp32", "fp16", "bf16") and torch's dtypes,
both ways, with the checks on dtype combinations that every stage shares.

DeepSpeed's long spellings ("float32", "bfloat16", "torch.float16", ...) are read into the
short names by :data:`DTYPE_NAMES` when a config is parsed (precision_sections.py); from
then on the config holds short names only, and the engine turns them into torch dtypes here.
torch is imported inside the functions, so that parsing a config never needs it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from zero_core.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from zero_core.interfaces.communicator import Communicator

#: DeepSpeed's dtype spellings (its DtypeEnum) -> zero-core's short name
DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}

#: short name -> the attribute of ``torch`` that is its dtype
_TORCH_ATTR = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def torch_dtype(name: str | None):
    """The torch dtype of a short name ("fp32", "fp16", "bf16"); None stays None."""
    if name is None:
        return None
    import torch
    return getattr(torch, _TORCH_ATTR[name])


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a torch dtype ("fp32", "bf16", "fp16"); other dtypes as torch
    prints them (they appear only in error messages)."""
    for short in _TORCH_ATTR:
        if torch_dtype(short) == dtype:
            return short
    return str(dtype)


def master_dtype_for(stage: int, compute_dtype: torch.dtype,
                     master_dtype: torch.dtype) -> torch.dtype:
    """*master_dtype* checked: fp32, or bf16 (``bf16.bf16_master_weights_and_grads``) under
    bf16 training at stages 1-3, as DeepSpeed allows it."""
    import torch
    if master_dtype == torch.float32:
        return master_dtype
    if master_dtype != torch.bfloat16 or compute_dtype != torch.bfloat16:
        raise ConfigError(f"master weights in {master_dtype} with {compute_dtype} training: the "
                          f"master is fp32, or bf16 with bf16.enabled and "
                          f"bf16.bf16_master_weights_and_grads")
    if stage == 0:
        raise ConfigError("bf16.bf16_master_weights_and_grads needs zero_optimization.stage 1, 2 "
                          "or 3 (DeepSpeed refuses stage 0 too): at stage 0 every rank holds the "
                          "whole bf16 parameters already, so a bf16 master would only duplicate "
                          "them. Set zero_optimization.stage to 1 or more, or remove the flag")
    return master_dtype


def comm_dtype_for(comm: Communicator, dtype: torch.dtype, op: str) -> torch.dtype:
    """*dtype* if *comm* can carry it for *op*; otherwise a ConfigError naming
    ``communication_data_type`` (both gradient reducers ask this)."""
    if not comm.supports(op, dtype):
        name = dtype_name(dtype)
        raise ConfigError(
            f"gradients are reduced in {name} (communication_data_type, default: the compute "
            f"dtype), but the {comm.name} communicator cannot carry {name} for {op}; set "
            f"communication_data_type to a dtype it carries (e.g. \"fp32\") or pick another "
            f"comm_backend")
    return dtype
