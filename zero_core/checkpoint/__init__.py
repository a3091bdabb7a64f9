"""Checkpoints: atomic and verified on disk, resharded on load, convertible.

- store.py — the storage layer: shard files, manifest with checksums, the atomic rename of a
  finished directory, ``latest``, verification;
- engine_state.py — an engine's state as fragments: what each rank saves, which saved
  ranges it reads on load (any world size, any stage);
- save_load.py — the collective save and load procedures (RNG, ``common.pt``, checks);
- convert.py — ``zero-core convert``: one consolidated safetensors state dict.
"""
