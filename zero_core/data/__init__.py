"""Data loading that survives restarts: sampler.py (ResumableSampler, resumable_loader)."""
from zero_core.data.sampler import ResumableSampler, resumable_loader

__all__ = ["ResumableSampler", "resumable_loader"]
