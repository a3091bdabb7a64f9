"""The ``vdev`` kernel set: zero-core's CPU kernels, run on vdev memory.

A vendor brings its own fused kernels here. vdev's compute is the host CPU, so each kernel
views its vdev operands as host tensors (``torch.vdev.host_view``: the same memory, no
copy, as a GPU kernel reads device memory in place), calls the CPU kernel, and returns
vdev tensors. Every kernel refuses operands that are not on vdev, so a buffer the engine
left on the host is an error here rather than a silent host computation.
"""
from __future__ import annotations

import torch

from zero_core.interfaces.kernels import KernelSet

from .device import NAME

CPU_OPTIM = "zero_core.accel_kernels.optim_cpu"
CPU_QUANT = "zero_core.accel_kernels.quant_cpu"


def _host(t, what: str):
    """The host view of the vdev tensor *t* (None stays None)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.device.type != NAME:
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"vdev kernel: {what} must be a vdev tensor, got one on {where}; "
                         f"the engine must keep this buffer on the device")
    return torch.vdev.host_view(t)


def _host_any(x, what: str):
    """A tensor or a list of tensors (the fused kernel takes either), as host views."""
    if isinstance(x, (list, tuple)):
        return [_host(t, f"{what}[{i}]") for i, t in enumerate(x)]
    return _host(x, what)


def _device_of(x) -> torch.device:
    return (x[0] if isinstance(x, (list, tuple)) else x).device


def adam_step(param, grad, exp_avg, exp_avg_sq, *, param_lowp=None, found_inf=None, **hyper):
    from zero_core.accel_kernels import optim_cpu
    optim_cpu.adam_step(_host(param, "param"), _host(grad, "grad"), _host(exp_avg, "exp_avg"),
                        _host(exp_avg_sq, "exp_avg_sq"),
                        param_lowp=_host(param_lowp, "param_lowp"),
                        found_inf=_host(found_inf, "found_inf"), **hyper)


def sgd_step(param, grad, momentum_buffer, *, param_lowp=None, found_inf=None, **hyper):
    from zero_core.accel_kernels import optim_cpu
    optim_cpu.sgd_step(_host(param, "param"), _host(grad, "grad"),
                       _host(momentum_buffer, "momentum_buffer"),
                       param_lowp=_host(param_lowp, "param_lowp"),
                       found_inf=_host(found_inf, "found_inf"), **hyper)


def _device_like(result, device):
    """Results of a CPU kernel (tensors or tuples of them) copied onto *device*."""
    if isinstance(result, torch.Tensor):
        return result.to(device)
    if isinstance(result, (tuple, list)):
        return type(result)(_device_like(r, device) for r in result)
    return result


def _run_quant(name, tensors, out, device, *args, **kwargs):
    """Call quant_cpu.*name* on host views; with *out*, the kernel writes vdev memory in
    place; without, its fresh host results are moved to *device*."""
    from zero_core.accel_kernels import quant_cpu
    fn = getattr(quant_cpu, name)
    host_out = None if out is None else _device_out_views(out)
    result = fn(*tensors, *args, out=host_out, **kwargs)
    return out if out is not None else _device_like(result, device)


def _device_out_views(out):
    if isinstance(out, torch.Tensor):
        return _host(out, "out")
    return type(out)(_device_out_views(o) for o in out)


def quantize(x, bits, block_size, *, out=None):
    return _run_quant("quantize", [_host(x, "x")], out, x.device, bits, block_size)


def dequantize(payload, scales, bits, block_size, *args, out=None, **kwargs):
    return _run_quant("dequantize", [_host(payload, "payload"), _host(scales, "scales")], out,
                      payload.device, bits, block_size, *args, **kwargs)


def dequantize_reduce_requantize(payloads, scales, bits, block_size, *args, out=None, **kwargs):
    return _run_quant("dequantize_reduce_requantize",
                      [_host_any(payloads, "payloads"), _host_any(scales, "scales")], out,
                      _device_of(payloads), bits, block_size, *args, **kwargs)


def kernel_set() -> KernelSet:
    return KernelSet(NAME, adam_step, sgd_step, info={
        "implementation": "zero-core's CPU kernels on vdev memory (host views, no copies)",
        "adam_step": f"{__name__}.adam_step -> {CPU_OPTIM}.adam_step",
        "sgd_step": f"{__name__}.sgd_step -> {CPU_OPTIM}.sgd_step",
        "quantize": f"{__name__} -> {CPU_QUANT}"},
        extra={"quantize": quantize, "dequantize": dequantize,
               "dequantize_reduce_requantize": dequantize_reduce_requantize},
        skips_on_device=True)  # the CPU kernels take found_inf (read in device memory)
