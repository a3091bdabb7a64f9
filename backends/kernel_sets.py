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
ipex       ``accel_kernels.optim_ipex`` (IPEX's fused ``adam_fused_step`` / ``sgd_fused_step``,
           each kind checked against the reference kernels on its first call, optim_cpu's
           kernels where the check fails); registered only where ipex.state() says an
           IPEX matching this torch is installed
=========  ==================================================================================

Quantization (ZeRO++): every set also carries ``quantize``, ``dequantize`` and
``dequantize_reduce_requantize`` in its ``extra`` dict (signatures and wire format:
``accel_kernels.quant_layout``), from ``quant_cpu`` (cpu, ipex), ``quant_triton`` (cuda, xpu; when
triton is installed), ``quant_hpu`` (hpu) or ``quant_reference`` (reference, and the
fallback of the others); ``info["quantize"]`` names the module, and for ``quant_cpu``
``info["quantize_path"]`` says whether its compiled C library or its torch path runs (with
``info["quantize_native_missing"]``: why not native). The engine reaches them only
through ``runtime.kernels.extra``.

IPEX (Intel Extension for PyTorch). Where it is installed, the cpu set's ``info["ipex"]`` says
whether it matches this torch (``backends/accelerators/ipex.py``; a mismatched IPEX is refused
unimported, with the reason). Only a matching IPEX gets an ``ipex`` set: without one there is
nothing to back it, and unlike ``hpu`` (the hpu accelerator's own set, which must always
exist) no accelerator names it, so it is absent rather than a fallback. The ``cpu`` set —
what the cpu accelerator and every offloaded optimizer step with — stays on torch's fused ops
by default: measured at 50M elements (ci/bench/ipex_kernels.py; docs/benchmarks.md, "IPEX
kernels"), IPEX's Adam is on par with them (0.92-1.17x their step time over six runs on a
shared machine), its AdamW is slower in every run (1.08-1.58x: there is no AdamW op, the
decoupled decay is an extra pass), its bf16 copy is no faster (its one-pass bf16 output is
only written for a bf16 gradient; with the interface's fp32 gradient it is ignored, so both
sets round in a second pass), and importing IPEX costs seconds per rank and replaces some of
torch's own CPU kernels. ``ZERO_CORE_CPU_KERNELS=ipex`` (environment, read when the registry
loads) makes the ``cpu`` set the IPEX kernels instead (``info["selected_by"]`` says so) and
imports IPEX right then, before any model runs: imported at the first optimizer step, it
changed the rounding of the forward passes after it, and offloaded training was no longer
bit-identical to training without offload (tests/test_offload_engine.py, measured). Where no
matching IPEX is installed, or it fails to import, the variable is answered with a warning and
the cpu kernels stay, with the reason in ``info["ipex"]``. ``ZERO_CORE_CPU_KERNELS=cpu`` (or
unset) is the default.

There is no Triton optimizer kernel: torch's fused ops already read and write each buffer
once per step. Each KernelSet's ``info`` names the functions that back it and, for a
fallback, why; ``zero-core report`` prints it. Modules that need a vendor library (triton,
habana_frameworks, IPEX) are only located here and import it on their first call, so
registering the kernel sets costs nothing on machines without that library (and imports
IPEX only where ``ZERO_CORE_CPU_KERNELS=ipex`` selects it).
"""
from __future__ import annotations

import importlib
import os
import warnings

import torch

from zero_core.errors import ConfigError, PluginError
from zero_core.interfaces.accelerator import module_present
from zero_core.interfaces.kernels import KernelSet

from .accelerators import ipex


PACKAGE = "zero_core.accel_kernels"

# Module names of the kernel families, one place to change if a kernel module is renamed.
REFERENCE = f"{PACKAGE}.optim_reference"
CPU = f"{PACKAGE}.optim_cpu"
FUSED = f"{PACKAGE}.optim_fused"
HPU = f"{PACKAGE}.optim_hpu"
IPEX = f"{PACKAGE}.optim_ipex"
QUANT_REFERENCE = f"{PACKAGE}.quant_reference"
QUANT_CPU = f"{PACKAGE}.quant_cpu"
QUANT_TRITON = f"{PACKAGE}.quant_triton"
QUANT_HPU = f"{PACKAGE}.quant_hpu"
#: the quantization kernels every set carries in ``KernelSet.extra``
QUANT_KERNELS = ("quantize", "dequantize", "dequantize_reduce_requantize")

#: the environment variable that picks what backs the ``cpu`` kernel set, and its values
CPU_KERNELS_ENV = "ZERO_CORE_CPU_KERNELS"
CPU_KERNELS_CHOICES = ("cpu", "ipex")

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


def _cpu_choice() -> str:
    """What ``ZERO_CORE_CPU_KERNELS`` asks the cpu set to be ("cpu" when unset)."""
    choice = os.environ.get(CPU_KERNELS_ENV, "").strip().lower() or "cpu"
    if choice not in CPU_KERNELS_CHOICES:
        raise ConfigError(f"{CPU_KERNELS_ENV}={os.environ[CPU_KERNELS_ENV]!r} is not a CPU "
                          f"kernel choice; use one of {', '.join(CPU_KERNELS_CHOICES)} (ipex: "
                          f"IPEX's fused optimizer ops, where a matching "
                          f"intel-extension-for-pytorch is installed) or unset it")
    return choice


def _ipex_set() -> tuple[KernelSet | None, str]:
    """(the ipex set, the ipex line) — the set only where a matching IPEX is installed."""
    kind, why = ipex.state()
    if kind != "ok":
        return None, why
    mod, failed = _import_kernels(IPEX)
    if mod is None:
        return None, f"{why}, but {failed}"
    ks = _with_quant(KernelSet("ipex", mod.adam_step, mod.sgd_step, info={
        "implementation": _summary(mod), **_names(IPEX), "ipex": why,
        "self-check": "each kind (adam, adamw, sgd; per low-precision dtype) is checked "
                      "against optim_reference on its first call and runs optim_cpu's "
                      "kernels if IPEX's op disagrees (the path lines below, once stepped)"},
        skips_on_device=True), QUANT_CPU)
    mod.report_into(ks.info)  # the self-check verdicts appear in info as they are reached
    return ks, why


def _cpu_sets(reference) -> tuple[KernelSet, KernelSet | None]:
    """(the cpu set, the ipex set or None); ZERO_CORE_CPU_KERNELS picks what backs cpu."""
    choice = _cpu_choice()
    ipex_set, ipex_why = _ipex_set()
    if choice == "ipex" and ipex_set is not None:
        # selected: IPEX is imported now, before any model runs, because its import replaces
        # some of torch's CPU kernels; imported at the first step it would change the
        # forward passes' rounding in the middle of a run
        mod = importlib.import_module(IPEX)
        if mod.load_ops() is not None:
            cpu = KernelSet("cpu", ipex_set.adam_step, ipex_set.sgd_step,
                            info={**ipex_set.info, "selected_by": f"{CPU_KERNELS_ENV}=ipex"},
                            extra=ipex_set.extra, skips_on_device=True)
            mod.report_into(cpu.info)
            return cpu, ipex_set
        ipex_why = mod.load_error()
    if choice == "ipex":
        warnings.warn(f"zero-core: {CPU_KERNELS_ENV}=ipex, but {ipex_why}; the cpu kernel set "
                      f"keeps torch's fused ops", RuntimeWarning, stacklevel=3)
    ipex_info = {} if ipex.state()[0] == "absent" else {"ipex": ipex_why}
    cpu, why = _import_kernels(CPU)
    if cpu is not None:
        cpu_set = KernelSet("cpu", cpu.adam_step, cpu.sgd_step, info={
            "implementation": _summary(cpu), **_names(CPU), **ipex_info}, skips_on_device=True)
    else:
        cpu_set = _reference_set("cpu", reference, fallback_reason=why, **ipex_info)
    return _with_quant(cpu_set, QUANT_CPU), ipex_set


def builtin_kernel_sets() -> list[KernelSet]:
    """The kernel sets the built-in plugin contributes: reference, cpu, cuda, xpu, hpu, and
    ipex where a matching IPEX is installed."""
    reference, why = _import_kernels(REFERENCE)
    if reference is None:
        raise PluginError(f"the reference optimizer kernels cannot be loaded: {why}. They are "
                          f"part of zero-core itself: reinstall it (pip install -e .)")
    sets = [_with_quant(_reference_set("reference", reference), QUANT_REFERENCE)]

    cpu_set, ipex_set = _cpu_sets(reference)
    sets.append(cpu_set)
    if ipex_set is not None:
        sets.append(ipex_set)

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
