"""ZeRO++ on top of stage 3: qwZ, hpZ and qgZ (DESIGN §4).

build_zeropp(engine, units) returns None while no ZeRO++ key is switched on.
"""
from __future__ import annotations


def build_zeropp(engine, units):
    """The ZeRO++ strategies for a stage-3 *engine*, or None when none is configured."""
    zc = engine.config.zero_optimization
    if not (getattr(zc, "zero_quantized_weights", False)
            or getattr(zc, "zero_quantized_nontrainable_weights", False)
            or getattr(zc, "zero_quantized_gradients", False)
            or getattr(zc, "zero_hpz_partition_size", 1) > 1):
        return None
    raise NotImplementedError("ZeRO++ is being built")
