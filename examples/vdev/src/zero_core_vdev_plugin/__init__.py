"""zero-core's plugin for the vdev device: accelerator, kernel set, device-aware communicator.

Importing it loads nothing of the device (see device.py); ``plugin`` is the entry point.
"""
