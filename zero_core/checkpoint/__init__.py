"""Checkpoints: atomic and verified on disk, resharded on load, convertible.

- store.py — the storage layer: shard files, manifest with checksums, the atomic rename of a
  finished directory, ``latest``, verification;
- engine_state.py — an engine's state as fragments: what each rank saves, which saved
  ranges it reads on load (any world size, any stage);
- save_load.py — the save and load procedures of an engine (RNG, ``common.pt``, checks);
- collective_save.py — the phases of a save and every rank's agreement after each;
- background.py — async saves: a host snapshot written by a thread, committed at a step;
- schedule.py — periodic saves, ``keep_last``, and the data position checkpoints carry;
- history.py — the complete checkpoints of a directory, newest first; pruning;
- resume.py — ``checkpoint.resume``: pick the newest, keep the global batch, load;
- convert.py — ``zero-core convert``: one consolidated safetensors state dict (also from a
  DeepSpeed directory);
- tags.py — ``checkpoint.tag_validation``: do all ranks save under the same tag;
- deepspeed_pickle.py — DeepSpeed's .pt files through an allow-list and torch's restricted
  unpickler (stand-ins for DeepSpeed's own classes; nothing else is ever constructed);
- deepspeed_layout.py — a DeepSpeed ZeRO directory (stages 0–3) as a fragment index, the
  form engine_state.py reads zero-core's own checkpoints in;
- deepspeed_resume.py — ``load_checkpoint`` on a DeepSpeed directory.
"""
