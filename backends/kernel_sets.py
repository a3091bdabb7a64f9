"""The built-in kernel sets, wired to ``zero_core.accel_kernels`` by module path.

=========  ==================================================================================
set        backed by (first that is present)
=========  ==================================================================================
reference  ``accel_kernels.optim_reference`` — pure torch, any device
cpu        ``accel_kernels.optim_cpu`` (torch's fused ops on CPU tensors, through
           ``accel_kernels.optim_fused``); else the reference kernels
cuda       ``accel_kernels.optim_fused``: torch's own fused ops (``torch._fused_adam_`` /
           ``_fused_adamw_`` / ``_fused_sgd_``); else the reference kernels
xpu        as cuda (torch's fused ops have XPU kernels)
hpu        ``accel_kernels.optim_hpu`` (Habana's fused optimizers,
           ``habana_frameworks.torch.hpex.optimizers.FusedAdamW`` / ``FusedSGD``) when
           habana_frameworks is installed; else the reference kernels
=========  ==================================================================================

Quantization (ZeRO++): every set also carries ``quantize``, ``dequantize`` and
``dequantize_reduce_requantize`` in its ``extra`` dict (signatures and wire format:
``accel_kernels.quant_layout``), from ``quant_cpu`` (cpu), ``quant_triton`` (cuda, xpu; when
triton is installed), ``quant_hpu`` (hpu) or ``quant_reference`` (reference, and the
fallback of the others); ``info["quantize"]`` names the module, and for ``quant_cpu``
``info["quantize_path"]`` says whether its compiled C library or its torch path runs (with
``info["quantize_native_missing"]``: why not native). The engine reaches them only
through ``runtime.kernels.extra``.

IPEX (Intel Extension for PyTorch): where it is installed, the cpu set's ``info["ipex"]``
says whether it matches this torch (``backends/accelerators/ipex.py``; a mismatched IPEX is
refused unimported, with the reason). The cpu set keeps torch's fused ops either way: IPEX
2.8's fused Adam (``torch.ops.torch_ipex.adam_fused_step``; it has no AdamW op) runs at the
same memory bandwidth (ci/bench/ipex_kernels.py), and importing IPEX costs seconds.

There is no Triton optimizer kernel: torch's fused ops already read and write each buffer
once per step. Each KernelSet's ``info`` names the functions that back it and, for a
fallback, why; ``zero-core report`` prints it. Modules that need a vendor library (triton,
habana_frameworks) are only located here and imported on the first call, so registering
the kernel sets costs nothing on machines without that library.
"""
from __future__ import annotations

import importlib
import warnings

import torch

from zero_core.errors import PluginError
from zero_core.interfaces.accelerator import module_present
from zero_core.interfaces.kernels import KernelSet

from .accelerators import ipex


PACKAGE = "zero_core.accel_kernels"

# Module names of the kernel families, one place to change if a kernel module is renamed.
REFERENCE = f"{PACKAGE}.optim_reference"
CPU = f"{PACKAGE}.optim_cpu"
FUSED = f"{PACKAGE}.optim_fused"
HPU = f"{PACKAGE}.optim_hpu"
QUANT_REFERENCE = f"{PACKAGE}.quant_reference"
QUANT_CPU = f"{PACKAGE}.quant_cpu"
QUANT_TRITON = f"{PACKAGE}.quant_triton"
QUANT_HPU = f"{PACKAGE}.quant_hpu"
#: the quantization kernels every set carries in ``KernelSet.extra``
QUANT_KERNELS = ("quantize", "dequantize", "dequantize_reduce_requantize")

TORCH_FUSED = "torch fused ops (torch._fused_adam_ / torch._fused_adamw_ / torch._fused_sgd_)"


class LazyKernel:
    """A kernel function named by module path, imported on its first call.

    Used for modules that import a vendor library at their top (triton, habana), so that
    the library is loaded only when a job really steps an optimizer with it.
    """

    def __init__(self, module: str, function: str):
        self.module, self.function = module, function
        self._fn = None

    def resolve(self):
        """Import the module and return the function (raises ImportError with context)."""
        if self._fn is None:
            try:
                self._fn = getattr(importlib.import_module(self.module), self.function)
            except (ImportError, AttributeError) as exc:
                raise PluginError(f"kernel {self.module}.{self.function} could not be loaded "
                                  f"({type(exc).__name__}: {exc}); install the library it "
                                  f"needs or select another kernel set") from exc
        return self._fn

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<lazy kernel {self.module}.{self.function}>"


def _import_kernels(module: str):
    """Import a pure-torch kernel module now: (module, None), or (None, why not)."""
    if not module_present(module):
        return None, f"{module} does not exist yet"
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # a bug in a kernel module must not take the registry down
        why = f"{module} failed to import ({type(exc).__name__}: {exc})"
        warnings.warn(f"zero-core: {why}; falling back to the reference kernels",
                      RuntimeWarning, stacklevel=2)
        return None, why


def _summary(module) -> str:
    """The first line of a kernel module's docstring: what its authors say it is."""
    doc = (module.__doc__ or "").strip()
    return doc.splitlines()[0].rstrip(".") if doc else module.__name__


def _names(module: str) -> dict:
    return {"adam_step": f"{module}.adam_step", "sgd_step": f"{module}.sgd_step"}


def _torch_fused_available() -> bool:
    """Whether this torch has the fused optimizer ops that ``optim_fused`` wraps."""
    return all(hasattr(torch, op) for op in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_"))


# ---- quantization kernels (KernelSet.extra) -----------------------------------------------
def _quant_extra(module: str, lazy: bool = False) -> tuple[dict, dict]:
    """(extra, info) for the quantization kernels of *module*, falling back to the reference
    module when it is missing or broken. *lazy*: import on first call (vendor libraries)."""
    if lazy:
        return ({k: LazyKernel(module, k) for k in QUANT_KERNELS}, {"quantize": module})
    mod, why = _import_kernels(module)
    info = {"quantize": module}
    if mod is None:
        mod, _ = _import_kernels(QUANT_REFERENCE)
        if mod is None:
            return {}, {"quantize": f"none ({why})"}
        info = {"quantize": QUANT_REFERENCE, "quantize_fallback_reason": why}
    # a module with several code paths says which one runs (quant_cpu: native C or torch)
    if hasattr(mod, "backend_info"):
        info.update(mod.backend_info())
    return {k: getattr(mod, k) for k in QUANT_KERNELS}, info


def _with_quant(ks: KernelSet, module: str, lazy: bool = False) -> KernelSet:
    """*ks* with the quantization kernels of *module* added to ``extra`` and ``info``."""
    extra, info = _quant_extra(module, lazy)
    return KernelSet(ks.name, ks.adam_step, ks.sgd_step, info={**ks.info, **info},
                     extra={**ks.extra, **extra}, skips_on_device=ks.skips_on_device)


def _device_quant_module() -> tuple[str, bool]:
    """cuda/xpu: the Triton quantization kernels when triton is installed, else reference."""
    if module_present(QUANT_TRITON) and module_present("triton"):
        return QUANT_TRITON, True
    return QUANT_REFERENCE, False


# ---- the sets ------------------------------------------------------------------------------
def _reference_set(name: str, reference, **info) -> KernelSet:
    info = {"implementation": "reference (pure torch)", **_names(REFERENCE), **info}
    return KernelSet(name, reference.adam_step, reference.sgd_step, info=info)


def _device_set(name: str, reference) -> KernelSet:
    """The cuda/xpu set: torch's fused ops through ``optim_fused``, else the reference."""
    if not _torch_fused_available():
        return _reference_set(name, reference, fallback_reason=f"torch {torch.__version__} "
                              f"has no fused optimizer ops")
    fused, why = _import_kernels(FUSED)
    if fused is None:
        return _reference_set(name, reference, fallback_reason=why)
    return KernelSet(name, fused.adam_step, fused.sgd_step,
                     info={"implementation": TORCH_FUSED, **_names(FUSED)}, skips_on_device=True)


def builtin_kernel_sets() -> list[KernelSet]:
    """The kernel sets the built-in plugin contributes: reference, cpu, cuda, xpu, hpu."""
    reference, why = _import_kernels(REFERENCE)
    if reference is None:
        raise PluginError(f"the reference optimizer kernels cannot be loaded: {why}. They are "
                          f"part of zero-core itself: reinstall it (pip install -e .)")
    sets = [_with_quant(_reference_set("reference", reference), QUANT_REFERENCE)]

    cpu, why = _import_kernels(CPU)
    ipex_kind, ipex_why = ipex.state()
    ipex_info = {} if ipex_kind == "absent" else {"ipex": ipex_why}
    if cpu is not None:
        sets.append(_with_quant(KernelSet("cpu", cpu.adam_step, cpu.sgd_step, info={
            "implementation": _summary(cpu), **_names(CPU), **ipex_info},
            skips_on_device=True), QUANT_CPU))
    else:
        sets.append(_with_quant(_reference_set("cpu", reference, fallback_reason=why,
                                               **ipex_info), QUANT_CPU))

    sets.append(_with_quant(_device_set("cuda", reference), *_device_quant_module()))
    sets.append(_with_quant(_device_set("xpu", reference), *_device_quant_module()))

    # optim_hpu imports habana_frameworks on its first call, so it is only picked where
    # that package can be found (as triton is for cuda/xpu)
    hpu_mod, why = _import_kernels(HPU)
    if hpu_mod is not None and module_present("habana_frameworks"):
        hpu = KernelSet("hpu", hpu_mod.adam_step, hpu_mod.sgd_step, info={
            "implementation": _summary(hpu_mod), **_names(HPU),
            "note": "momentum SGD with dampening != 0 runs the reference kernel; not yet "
                    "run on Gaudi hardware (optim_hpu.status() after a step tells the path)"})
    else:
        why = why or "habana_frameworks is not installed (it ships with Intel Gaudi's stack)"
        hpu = _reference_set(
            "hpu", reference,
            fallback_reason=f"{why}; the reference kernels run as ordinary torch ops on the "
                            f"card through Habana's bridge")
    sets.append(_with_quant(hpu, QUANT_HPU))
    return sets
