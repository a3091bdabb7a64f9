"""Checkpoints: atomic and verified on disk, resharded on load, convertible.

- store.py — the storage layer: shard files, manifest with checksums, the atomic rename of a
  finished directory, ``latest``, verification;
- engine_state.py — an engine's state as fragments: what each rank saves, which saved
  ranges it reads on load (any world size, any stage);
- save_load.py — the collective save and load procedures (RNG, ``common.pt``, checks);
- convert.py — ``zero-core convert``: one consolidated safetensors state dict (also from a
  DeepSpeed directory);
- tags.py — ``checkpoint.tag_validation``: do all ranks save under the same tag;
- deepspeed_pickle.py — DeepSpeed's .pt files through an allow-list and torch's restricted
  unpickler (stand-ins for DeepSpeed's own classes; nothing else is ever constructed);
- deepspeed_layout.py — a DeepSpeed ZeRO directory (stages 0–3) as a fragment index, the
  form engine_state.py reads zero-core's own checkpoints in;
- deepspeed_resume.py — ``load_checkpoint`` on a DeepSpeed directory.
"""
