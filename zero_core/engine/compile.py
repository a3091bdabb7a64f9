"""``engine.compile()``: torch.compile the model block by block, around zero-core's hooks.

What is compiled. The model's *blocks*: the children of its longest ``nn.ModuleList`` /
``nn.Sequential`` whose children are all of one class (a transformer's layers); a model
without such a list is compiled whole. Each block's ``forward`` is replaced by its compiled
version (``torch.compile(block.forward, ...)``), so the module's own ``__call__`` — and the
hooks zero-core registers on it — stay eager; blocks of one class share their compiled code
(parameters are graph inputs, torch's default since 2.5).

What stays eager, and why:

* gradient reduction: the post-accumulate-grad hooks of the parameters run when autograd
  accumulates a leaf's gradient, after the compiled backward has produced it — unchanged;
* stage 3's gathers: every module of the model carries a forward pre/post hook that
  gathers and releases its fetch units (collectives, a state machine). Inside a compiled
  block those hooks are excluded from tracing (``torch._dynamo.disable``), so each submodule
  call is a graph break: the code *between* submodule calls (residual adds, activations,
  attention arithmetic) is what compiles. The count is reported;
* activation checkpointing: a checkpointed block recomputes by calling the compiled forward
  again;
* the optimizer step and the step decisions (engine/update.py): already fused kernels.

Compiling sets ``torch._dynamo.config.skip_nnmodule_hook_guards = False`` for the process:
code compiled for a block class before the engine's hooks existed must not be reused
without them. Graph breaks and recompilations are counted over the first compiled calls and logged once
on rank 0 (:func:`compile_report`, ``engine.compile_report()``). DeepSpeed's ``schedule``
argument and the ``compile.deepcompile`` switch belong to DeepCompile, DeepSpeed's own
compiler passes, which zero-core does not implement: both are refused by name.
"""
from __future__ import annotations

import logging

import torch

from zero_core.errors import ConfigError

log = logging.getLogger("zero_core.engine")

# the hooks stage 3 registers on every module (stage3/module_hooks.py StageHooks)
_STAGE3_HOOKS = "_zero_core_stage3_hooks"


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to compile: the children of the longest ModuleList/Sequential
    whose children share one class; else the model itself."""
    best: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            kids = list(m.children())
            if len(kids) > len(best) and len({type(k) for k in kids}) == 1:
                best = kids
    return best or [model]


def compile_engine(engine, backend="inductor", compile_kwargs: dict | None = None,
                   schedule=None) -> None:
    """Compile *engine*'s model in place (see the module docstring). Idempotent."""
    if schedule is not None:
        raise ConfigError(
            "engine.compile(schedule=...): compile schedules are DeepSpeed's DeepCompile, which "
            "zero-core does not implement; call engine.compile() without a schedule (torch.compile "
            "per block, engine/compile.py)")
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        raise ConfigError("engine.compile: give the backend as backend=..., not inside "
                          "compile_kwargs")
    if getattr(engine, "_compiled", False):
        log.warning("zero-core: engine.compile() called again: the model is already compiled")
        return
    blocks = find_blocks(engine.module)
    # dynamo by default does not guard on module hooks: code compiled for a block class
    # before zero-core's hooks existed (another engine, an eager run) would be reused
    # without them — at stage 3, without its gathers. Guard on them.
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    _keep_hooks_eager(engine.module)
    for block in blocks:
        original = block.forward
        block.forward = torch.compile(original, backend=backend, **kwargs)
        block.__dict__["_zero_core_eager_forward"] = original
    engine._compiled = True
    engine._compile_blocks = blocks
    engine._compile_counts = _counters_now()
    if engine.global_rank == 0:
        kinds = sorted({type(b).__name__ for b in blocks})
        log.info("zero-core: compiled %d block(s) of %s with backend %r", len(blocks),
                 ", ".join(kinds), backend)


def unwrap_compiled(model: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
    """``(module, was_compiled)``: the module inside a ``torch.compile`` wrapper, or *model*.

    ``initialize(model=torch.compile(m))`` would trace the whole model — at stage 3 with its
    gather hooks, which dynamo cannot trace (it fails in the first forward). The engine takes
    the plain module and :func:`compile_engine` compiles its blocks instead, as the
    Lightning strategy does for ``trainer.fit(torch.compile(module))``. The wrapper's
    backend and options cannot be read back from it (torch keeps them inside a callback),
    so the blocks compile with the defaults; the notice says how to choose them.
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return model._orig_mod, True
    return model, False


def _keep_hooks_eager(model: torch.nn.Module) -> None:
    """Exclude stage 3's module hooks from tracing: they gather and release parameters
    (collectives, bookkeeping) and must run as Python, between compiled regions."""
    hooks = model.__dict__.get(_STAGE3_HOOKS)
    if hooks is None:
        return
    for m in model.modules():
        for table in (m._forward_pre_hooks, m._forward_hooks):
            for key, fn in list(table.items()):
                if getattr(fn, "__self__", None) is hooks and not hasattr(fn, "_torchdynamo_disable"):
                    table[key] = torch._dynamo.disable(fn)


def _counters_now() -> dict:
    from torch._dynamo.utils import counters
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"].get("unique_graphs", 0)}


def compile_report(engine) -> dict:
    """Blocks compiled, and graph breaks / graphs compiled since ``engine.compile()``
    (process-wide dynamo counters: other compiled code in the process counts too)."""
    if not getattr(engine, "_compiled", False):
        return {"compiled": False}
    from torch._dynamo.utils import counters
    now, then = _counters_now(), engine._compile_counts
    reasons: dict[str, int] = {}
    for k, v in counters["graph_break"].items():   # first line of each reason
        first = k.strip().splitlines()[0][:120]
        reasons[first] = reasons.get(first, 0) + v
    return {"compiled": True, "blocks": len(engine._compile_blocks),
            "block_class": sorted({type(b).__name__ for b in engine._compile_blocks}),
            "graph_breaks": now["graph_breaks"] - then["graph_breaks"],
            "graphs": now["unique_graphs"] - then["unique_graphs"],
            "break_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:5])}
