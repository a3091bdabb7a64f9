"""ZeRO++ on top of stage 3 (ARCHITECTURE §4): less inter-node traffic for the same training.

Where things are:

- wire.py — how a quantized tensor (payload + fp32 block scales) is packed into byte slots;
- qwz.py — qwZ: a fetch unit's all-gather as int8 slots, dequantized on arrival;
- hpz.py — hpZ: secondary partitions inside the node, so re-gathers stay in the node;
- fetch.py — the gather strategy that picks among them for each gather;
- qgz.py — qgZ: gradient reduction as a two-hop int4 all-to-all, with its fallbacks;
- handles.py — in-flight work (a collective plus what runs after it);
- strategies.py — ZeroPlusPlus, what the stage-3 engine talks to;
- volume.py — inter-node bytes per rank and step of ZeRO-3 and ZeRO++ (formulas).

Configuration (stage 3 only): ``zero_optimization.zero_quantized_weights``,
``zero_quantized_nontrainable_weights``, ``zero_hpz_partition_size`` (normally the ranks per
node), ``zero_quantized_gradients``.
"""
from __future__ import annotations


def build_zeropp(ctx, units, param_store=None):
    """The ZeRO++ strategies for stage 3's fetch *units* (*ctx*: the engine's
    ``BuildContext``; *param_store*: the parameter offload store, if any), or None when no
    ZeRO++ key is switched on. Collective (hpZ and qgZ create groups)."""
    if not ctx.config.zero_optimization.zeropp_enabled:
        return None
    from zero_core.zeropp.strategies import ZeroPlusPlus
    return ZeroPlusPlus(ctx, units, param_store)
