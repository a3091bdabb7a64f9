"""Device kernels (installed as ``zero_core.accel_kernels``): optimizer steps (``optim_*``) and
block-wise quantization (``quant_*``), each family with a pure-torch reference that the
faster targets must match. Plain functions on tensors: this package knows nothing about ZeRO
and imports nothing from the engine.
"""
