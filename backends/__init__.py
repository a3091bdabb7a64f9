"""zero-core's built-in backends (installed as ``zero_core.backends``): the accelerators
(``accelerators/``), the communicators (``comm/``) and the kernel sets (``kernel_sets.py``),
registered by ``plugin.py`` through the ``zero_core`` entry point like any third-party plugin.

They implement ``zero_core.interfaces`` and may import only it, ``zero_core.errors`` and the
kernels (``zero_core.accel_kernels``); the engine never imports them, it finds them through
the registry.
"""
