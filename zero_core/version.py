"""The package version, in a module of its own so that engine code can record it (checkpoint
manifests, ``zero-core env``) without importing the package's public API."""
__version__ = "0.1.0"
