"""ZeroPlusPlus: qwZ, hpZ and qgZ assembled for one stage-3 model.

Stage 3's parts (zero_core/stage3/parts.py) build this object once the fetch units
exist, hands ``fetch`` to its UnitGatherer and ``reduce_unit`` to its gradient reducer,
calls ``partitions_changed()`` after every optimizer step and checkpoint restore, and
adds ``memory_report()`` to its own under ``"zeropp"``. Quantization kernels come from the
runtime's kernel set (``runtime.kernels.extra``), never from accel_kernels directly.
"""
from __future__ import annotations

import logging

from zero_core.errors import ConfigError
from zero_core.zeropp.fetch import UnitFetch
from zero_core.zeropp.hpz import SecondaryPartitions, hpz_group
from zero_core.zeropp.qgz import TwoHopGradientReduce
from zero_core.zeropp.qwz import QuantizedGather

log = logging.getLogger("zero_core.zeropp")

QUANT_KERNELS = ("quantize", "dequantize", "dequantize_reduce_requantize")


def quantization_kernels(kernel_set) -> dict:
    """The kernel set's quantization kernels, or a ConfigError saying how to get them."""
    missing = [k for k in QUANT_KERNELS if k not in kernel_set.extra]
    if missing:
        raise ConfigError(
            f"ZeRO++ qwZ/qgZ need quantization kernels, but kernel set '{kernel_set.name}' has "
            f"no {', '.join(missing)} in its extra dict; add them (see "
            f"zero_core/backends/kernel_sets.py) or set zero_quantized_weights, "
            f"zero_quantized_nontrainable_weights and zero_quantized_gradients to false")
    return {k: kernel_set.extra[k] for k in QUANT_KERNELS}


class ZeroPlusPlus:
    """The ZeRO++ strategies of one engine (see module docstring)."""

    def __init__(self, ctx, units, param_store=None):
        zc = ctx.config.zero_optimization
        comm = ctx.comm
        if param_store is not None:
            # the gather strategies read u.part in device memory; offloaded partitions are
            # fetched by the plain gather path only (zero_core/offload/params.py)
            raise ConfigError("ZeRO++ (zero_quantized_weights / zero_hpz_partition_size / "
                              "zero_quantized_gradients) together with "
                              "zero_optimization.offload_param is not supported yet; switch "
                              "one of them off")
        self.comm = comm
        self.elem_bytes = ctx.compute_dtype.itemsize
        qw = zc.zero_quantized_weights or zc.zero_quantized_nontrainable_weights
        kernels = (quantization_kernels(ctx.kernels)
                   if qw or zc.zero_quantized_gradients else None)
        self.qwz = QuantizedGather(comm, kernels) if qw else None
        self.hpz = None
        if zc.zero_hpz_partition_size > 1:
            group = hpz_group(comm, zc.zero_hpz_partition_size)
            self.hpz = SecondaryPartitions(comm, group, units, ctx.compute_dtype,
                                           ctx.device)
        self.fetch = (UnitFetch(comm, self.qwz, not zc.zero_quantized_weights, self.hpz)
                      if self.qwz is not None or self.hpz is not None else None)
        self.qgz = (TwoHopGradientReduce(comm, kernels) if zc.zero_quantized_gradients
                    else None)
        self.units = units
        self.config = zc
        if self.qgz is not None and comm.rank == 0:
            falling = [u for u in units if u.trainable and self.qgz.fallback_reason(u)]
            if falling:
                log.info("qgZ: %d of %d trainable fetch units reduce with the ordinary "
                         "reduce-scatter (reasons logged at their first reduction)",
                         len(falling), sum(u.trainable for u in units))
        log.info("ZeRO++: qwZ %s, hpZ %s, qgZ %s",
                 "off" if self.qwz is None else (
                     "all weights" if zc.zero_quantized_weights else "frozen weights"),
                 "off" if self.hpz is None else f"{self.hpz.size} ranks",
                 "on" if self.qgz is not None else "off")

    @property
    def reduce_unit(self):
        """The stage-3 reducer's collective (qgZ), or None for the plain reduce-scatter."""
        return self.qgz

    def partitions_changed(self) -> None:
        """Every partition may have changed: hpZ's secondary copies are stale."""
        if self.hpz is not None:
            self.hpz.invalidate_all()

    def memory_report(self) -> dict:
        """hpZ's extra partition (bytes, and its formula: the compute-dtype bytes of the
        non-persistent units' padded elements / hpZ size) and counters of each path."""
        rep = {"qwz": self.qwz is not None, "hpz_partition_size": 1,
               "qgz": self.qgz is not None, "hpz_secondary_partition": 0,
               "hpz_secondary_partition_formula": 0}
        if self.hpz is not None:
            elems = sum(u.padded_numel for u in self.units if not u.persistent)
            rep.update(hpz_partition_size=self.hpz.size,
                       hpz_secondary_partition=self.hpz.nbytes,
                       hpz_secondary_partition_formula=elems * self.elem_bytes // self.hpz.size,
                       hpz_secondary_gathers=self.hpz.gathers,
                       hpz_refreshes=self.hpz.refreshes)
        if self.qwz is not None:
            rep["qwz_quantized_gathers"] = self.qwz.gathers
        if self.fetch is not None:
            rep["exact_gathers"] = self.fetch.exact_gathers
        if self.qgz is not None:
            rep["qgz_quantized_reductions"] = self.qgz.quantized_reductions
            rep["qgz_fallback_reductions"] = self.qgz.fallback_reductions
        return rep
