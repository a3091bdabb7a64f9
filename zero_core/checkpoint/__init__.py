"""Checkpoints: atomic and verified on disk, resharded on load, convertible.

- store.py — the storage layer: shard files, manifest with checksums, the atomic rename of a
  finished directory, ``latest``, verification;
- engine_state.py — what an engine puts into its shard and how it gathers and restores
  its state (any world size, any stage);
- convert.py — ``zero-core convert``: one consolidated safetensors state dict.
"""
