"""An example zero-core plugin (and a template for yours).

It contributes the accelerator ``example-cpu`` and the communicator ``example-gloo``;
zero-core finds them through the ``zero_core`` entry point declared in pyproject.toml.
Keep this module light: zero-core imports the plugin module on every start, and the
backend modules only when a hook asks for them.
"""
__version__ = "0.1.0"
