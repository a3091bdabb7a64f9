"""``engine.generate`` and ``gathered_for_generation``.

How ``engine.generate`` gathers at stage 3 (stages 0-2 hold the whole model already):

==========================================  ==================================================
``hybrid_engine``                           gathering for the call
==========================================  ==================================================
disabled (default)                          the generation cache: units kept across decode
                                            steps within ``generation.max_live_parameters``,
                                            the rest streamed per step; released on return
enabled, ``pin_parameters: true``           the whole model gathered once, hooks off (as fast
                                            as the plain model; DeepSpeed gathers all layers)
enabled, ``pin_parameters: false``          the generation cache, as when disabled
enabled, ``release_inference_cache: true``  released when generate returns
enabled, ``release_inference_cache: false`` kept gathered until training resumes (the next
                                            forward with autograd, ``engine.train()``, the
                                            optimizer step), so back-to-back generate calls
                                            gather once
==========================================  ==================================================

Ranks in step: at stage 3 on several ranks, when decode steps gather (the model does not
fit the generation budget) and ``torch.distributed`` is initialized (gloo, nccl, ...),
``synced_gpus=True`` is passed to Hugging Face's generate unless the caller chose: ranks
that finish early keep stepping (its per-step all-reduce is not paid when nothing streams). Under MPI it is not (HF's flag
all-reduces through torch.distributed); ranks that stop at different steps while units
stream fail with ``GenerationDivergedError`` (stage3/generation_cache.py) instead of
hanging. When the whole model is kept, decode steps issue no collective and ranks may
finish at different steps.
"""
from __future__ import annotations

import contextlib

import torch

from zero_core.errors import ZeroCoreError


def _refuse_bad_moment(engine) -> None:
    if torch._C._current_graph_task_id() != -1:
        raise ZeroCoreError("engine.generate was called inside a backward pass (from a "
                            "gradient hook or autograd.Function.backward); generate before "
                            "engine.backward(loss) or after engine.step()")
    if engine.parts.awaiting_backward():
        raise ZeroCoreError("engine.generate between a forward with autograd and its "
                            "engine.backward(loss): generation would release the parameters "
                            "that backward needs. Call engine.backward(loss) (and "
                            "engine.step()) first, or run that forward under torch.no_grad()")


def _check_max_out_tokens(engine, args, kwargs) -> None:
    """hybrid_engine.max_out_tokens bounds prompt + new tokens, as DeepSpeed's inference
    workspace does."""
    limit = engine.config.hybrid_engine.max_out_tokens
    ids = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input_ids")
    prompt = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 0
    gen_cfg = kwargs.get("generation_config") or getattr(engine.module, "generation_config", None)
    new = kwargs.get("max_new_tokens", getattr(gen_cfg, "max_new_tokens", None))
    total = prompt + new if new is not None else kwargs.get(
        "max_length", getattr(gen_cfg, "max_length", None))
    if total is not None and total > limit:
        raise ZeroCoreError(f"engine.generate: prompt ({prompt} tokens) plus new tokens come "
                            f"to {total}, above hybrid_engine.max_out_tokens = {limit}; raise "
                            f"max_out_tokens in the config or generate fewer tokens")


def generate(engine, *args, **kwargs):
    """``engine.generate(...)``: the model's own ``generate`` without autograd, in eval mode
    (the module's mode is restored afterwards), gathering as the module docstring says."""
    module = engine.module
    if not callable(getattr(module, "generate", None)):
        raise ZeroCoreError(f"engine.generate calls the model's own generate() (Hugging Face's "
                            f"GenerationMixin); {type(module).__name__} has none. Write the "
                            f"decode loop with engine(...) under torch.no_grad() (stage 3 keeps "
                            f"the parameters gathered between its steps as it does here)")
    _refuse_bad_moment(engine)
    he = engine.config.hybrid_engine
    if he.enabled:
        _check_max_out_tokens(engine, args, kwargs)
    args = tuple(engine._to_device(a) for a in args)
    kwargs = {k: engine._to_device(v) for k, v in kwargs.items()}
    # stages 0-2 hold the whole model: their gathered_model is the model itself
    whole = he.enabled and he.pin_parameters
    # only decode steps that gather (the model does not fit the generation budget) issue
    # collectives that need the ranks in step
    if (not whole and engine.parts.generation_streams() and engine.world_size > 1
            and "synced_gpus" not in kwargs
            and torch.distributed.is_available() and torch.distributed.is_initialized()):
        kwargs["synced_gpus"] = True
    keep = he.enabled and not he.release_inference_cache
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), engine._autocast():
            if whole:
                with engine.parts.gathered_model(module, keep=keep) as model:
                    return model.generate(*args, **kwargs)
            return module.generate(*args, **kwargs)
    finally:
        module.train(was_training)
        if not keep:
            engine.parts.end_generation()


@contextlib.contextmanager
def gathered_for_generation(engine):
    """Yield the plain model with every parameter gathered (stage 3: exact values in the
    compute dtype, the engine's hooks off) for code that calls ``model.generate`` itself;
    on exit the hooks come back and the gathered copies are released. Needs the whole
    model in memory once: with less, use ``engine.generate`` or call ``engine.module``'s
    generate directly (the generation budget applies). Stages 0-2: the model itself."""
    _refuse_bad_moment(engine)
    with engine.parts.gathered_model(engine.module) as model:
        yield model
