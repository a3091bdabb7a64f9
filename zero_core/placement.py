"""Moving the user's model onto the engine's device without replacing its parameters.

``Module.to(device)`` keeps each ``Parameter`` object only when torch can swap the new
tensor in with ``param.data = ...``, which it allows between the built-in dense devices
(cpu, cuda, xpu, hpu, mps) but not for an out-of-tree PrivateUse1 device (Ascend's
``npu``, our ``vdev``). There it builds *new* Parameter objects, and every reference the
user or the engine already holds (optimizer param groups, ``model_parameters``, tied
weights found by identity) points at the old CPU tensor. :func:`move_parameter` keeps the
object and swaps its contents instead (``torch.utils.swap_tensors``).
"""
from __future__ import annotations

import torch


def _keeps_identity(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor.data = tensor.data.to(device)`` is allowed."""
    probe = torch.empty(0, dtype=tensor.dtype, device=device)
    return torch._has_compatible_shallow_copy_type(tensor, probe)


def set_data(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """``param.data = tensor``, also where torch refuses it (another device type, see the
    module docstring): then the contents are swapped in and *param* keeps its class and
    attributes (``swap_tensors`` would exchange those too)."""
    if param.device.type == tensor.device.type or _keeps_identity(param, tensor.device):
        param.data = tensor
        return
    cls, attrs = type(param), dict(param.__dict__)
    if param.grad is not None:
        param.grad = None  # a gradient on the old device could not follow the swap
    replacement = (torch.nn.Parameter(tensor, requires_grad=param.requires_grad)
                   if isinstance(param, torch.nn.Parameter) else tensor.detach())
    torch.utils.swap_tensors(param, replacement)
    param.__class__ = cls
    param.__dict__.clear()
    param.__dict__.update(attrs)


def move_parameter(param: torch.Tensor, device: torch.device) -> None:
    """Put *param*'s data on *device*, keeping the Python object (and its attributes)."""
    if param.device != device:
        set_data(param, param.data.to(device))


def move_module(module: torch.nn.Module, device: torch.device, parameters: bool = True) -> None:
    """``module.to(device)`` for parameters (objects kept) and buffers (re-assigned);
    *parameters*=False moves the buffers only (stage 3 places its parameters itself)."""
    if parameters:
        for p in module.parameters():
            move_parameter(p, device)
    for m in module.modules():
        for key, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[key] = b.to(device)
