"""The GPU kit's engine checks: each engine case trained against plain torch on the same
device (loss curve, gradient norm, final weights), and where the engine's tensors are
(device or host memory) judged against the case's offload settings.
"""
from __future__ import annotations

import copy
import math
import tempfile
import time
import types
from collections import deque

from check_support import (Ctx, gpt_module, import_torch, learnable_batches, release_memory,
                           runtime, synchronize)
from engine_cases import (EngineCase, build_engine, engine_weights, rel_curve_diff,
                          rel_weight_diff, sizes, train_engine, train_reference)


# ---- placement --------------------------------------------------------------------------
_LEAF_TYPES = (str, bytes, int, float, bool, complex, type(None), type, types.FunctionType,
               types.BuiltinFunctionType, types.MethodType, types.ModuleType)
_SKIP_PACKAGES = ("threading", "concurrent", "queue", "logging", "weakref", "_thread", "mmap",
                  "numpy", "subprocess", "io", "_io", "ctypes", "torch", "pluggy")
_OPT_STORE_CLASSES = {"HostStateStore", "NvmeStateStore", "SwappedFlatBuffer",
                      "MasterWriteThrough"}
_PARAM_STORE_CLASSES = {"ParamOffload", "_MappedParams"}


def engine_tensors(engine) -> list:
    """Every tensor reachable from *engine*'s attributes (breadth first, so each tensor gets
    its shortest path), as (path, owner class names along the path, tensor). The model's
    own parameters and buffers are listed under ``module.`` by name; other modules, the
    shared runtime and the config are not entered."""
    torch = import_torch()
    seen, found = set(), []
    queue = deque([(engine, "engine", ())])
    for n, p in engine.module.named_parameters():
        seen.add(id(p))
        found.append((f"module.{n}", ("Parameter",), p.data))
    for n, b in engine.module.named_buffers():
        seen.add(id(b))
        found.append((f"module.{n}", ("Buffer",), b))
    seen.add(id(engine))
    while queue:
        obj, path, owners = queue.popleft()
        if len(owners) > 14:
            continue
        if isinstance(obj, dict):
            items = [(f"{path}[{k!r}]" if isinstance(k, (str, int)) else f"{path}[?]", v)
                     for k, v in list(obj.items())]
            next_owners = owners
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(list(obj))]
            next_owners = owners
        else:
            items = []
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                items += [(f"{path}.{k}", v) for k, v in list(attrs.items())]
            for k in getattr(type(obj), "__slots__", ()) or ():
                if isinstance(k, str) and hasattr(obj, k):
                    items.append((f"{path}.{k}", getattr(obj, k)))
            next_owners = owners + (type(obj).__name__,)
        for child_path, child in items:
            if id(child) in seen or isinstance(child, _LEAF_TYPES):
                continue
            if isinstance(child, (torch.dtype, torch.device, torch.Generator)):
                continue
            if isinstance(child, torch.Tensor):
                seen.add(id(child))
                found.append((child_path, next_owners, child))
                continue
            if obj is engine and child_path.split(".")[-1] in (
                    "module", "runtime", "comm", "config", "_modules", "_parameters",
                    "_forward_hooks", "_backward_hooks", "memory_ledger"):
                continue
            if isinstance(child, torch.nn.Module):
                continue
            package = (type(child).__module__ or "").split(".")[0]
            if package in _SKIP_PACKAGES:
                continue
            seen.add(id(child))
            queue.append((child, child_path, next_owners))
    return found


def placement(engine, case: EngineCase, device_type: str) -> dict:
    """Which engine-owned tensors are on the device and which in host memory, judged
    against the configuration: everything with more than one element belongs on the
    device, except (offload_optimizer) the fp32 master weights, optimizer states and the
    host gradient staging of the offloaded step, and (offload_param) the stage-3 parameter
    partitions and their staging buffers. Conversely, offloaded states found on the device
    are reported too. Model parameters (``module.*``) must be on the device whatever their
    size (stage 3 placeholders included)."""
    on_dev = on_host = 0
    dev_bytes = host_bytes = 0
    wrong_host, wrong_dev = [], []
    for path, owners, t in engine_tensors(engine):
        if t.device.type == "meta":
            continue
        nbytes = t.numel() * t.element_size()
        is_dev = t.device.type == device_type
        leaf = path.replace(".data", "").rsplit(".", 1)[-1]
        opt_side = (bool(_OPT_STORE_CLASSES & set(owners)) or ".master" in path
                    or "flat_state" in path or "optimizer.store" in path
                    or "exp_avg" in path)
        param_side = (bool(_PARAM_STORE_CLASSES & set(owners)) or "part_source" in path
                      or "param_offload" in path
                      or (case.stage == 3 and leaf.split("[")[0] in ("part", "param_buf")))
        if is_dev:
            on_dev += 1
            dev_bytes += nbytes
            if device_type != "cpu" and t.numel() > 1 and t.is_floating_point() and (
                    (case.offload_optimizer != "none" and opt_side and "grad" not in leaf
                     and t.dtype == import_torch().float32)
                    or (case.offload_param != "none" and param_side
                        and leaf.split("[")[0] in ("part", "param_buf"))):
                wrong_dev.append(f"{path} {tuple(t.shape)} {str(t.dtype)[6:]}")
            continue
        on_host += 1
        host_bytes += nbytes
        if device_type == "cpu":
            continue
        if path.startswith("module."):
            # a parameter's device is what user code reads (stage-3 placeholders too)
            wrong_host.append(f"{path} {tuple(t.shape)} {str(t.dtype)[6:]}")
            continue
        if t.numel() <= 1:
            continue
        allowed = ((case.offload_optimizer != "none" and opt_side)
                   or (case.offload_param != "none" and param_side))
        if not allowed:
            wrong_host.append(f"{path} {tuple(t.shape)} {str(t.dtype)[6:]} "
                              f"(owners {'/'.join(owners[-3:])})")
    return {"tensors_on_device": on_dev, "tensors_on_host": on_host,
            "device_MiB": round(dev_bytes / 2**20, 2), "host_MiB": round(host_bytes / 2**20, 2),
            "unexpected_on_host": wrong_host[:20], "unexpected_on_host_count": len(wrong_host),
            "unexpected_on_device": wrong_dev[:20], "unexpected_on_device_count": len(wrong_dev)}


def run_engine_case(ctx: Ctx, case: EngineCase) -> dict:
    """Train the GPT with the engine and with plain torch on the same device and batches;
    compare loss curves, gradient norms and the final weights; check placement. Bounds:
    fp32 loss curve within 1e-3 relative of torch fp32 and the first step's gradient norm
    (same weights on both sides) within 1e-4; bf16 within 2e-2 / 1e-2 of torch's bf16 mixed
    precision (same rounding points, different kernels and summation orders). Later norms
    and the final weights are reported, not judged (bf16 trajectories drift apart)."""
    torch = import_torch()
    from zero_core.errors import ConfigError
    rt = runtime(ctx)
    sz = sizes(ctx)
    nvme_dir = tempfile.mkdtemp(prefix=f"nvme_{case.name}_", dir=ctx.scratch)
    gpt = gpt_module()
    vocab = gpt.GPTConfig.preset(sz.preset).vocab_size
    batches = learnable_batches(sz.steps * sz.gas, sz.micro, sz.seq, vocab, ctx.seed)
    try:
        engine, initial, cfg = build_engine(ctx, case, sz, nvme_dir, ctx.seed)
    except ConfigError as exc:
        if case.hpz > 1:
            return {"status": "refused", "numbers": {"message": str(exc)},
                    "detail": f"refused at world size 1: {str(exc)[:160]}"}
        raise
    try:
        t0 = time.perf_counter()
        losses, norms = train_engine(engine, batches, rt.device)
        synchronize(ctx)
        train_s = time.perf_counter() - t0
        weights = engine_weights(engine)
        place = placement(engine, case, rt.device.type)
        mem = engine.memory_report()
        zeropp = mem.get("zeropp")
    finally:
        engine.destroy()
    ref_losses, ref_norms, ref_weights = train_reference(
        copy.deepcopy(initial), batches, sz, case.precision, rt.device)
    fp32_losses = ref_losses
    if case.precision != "fp32":
        fp32_losses = train_reference(copy.deepcopy(initial), batches, sz, "fp32",
                                      rt.device)[0]
    loss_tol, norm_tol = (1e-3, 1e-4) if case.precision == "fp32" else (2e-2, 1e-2)
    curve = rel_curve_diff(losses, ref_losses)
    # the first step's norm comes from identical weights: only summation orders differ
    norm_diff = abs(norms[0] - ref_norms[0]) / max(abs(ref_norms[0]), 1e-12)
    numbers = {"losses": [round(v, 5) for v in losses],
               "reference_losses": [round(v, 5) for v in ref_losses],
               "loss_curve_max_rel_diff": curve,
               "loss_curve_max_rel_diff_vs_torch_fp32": rel_curve_diff(losses, fp32_losses),
               "grad_norms": norms, "reference_grad_norms": ref_norms,
               "grad_norm_rel_diff": norm_diff,
               "last_grad_norm_rel_diff": abs(norms[-1] - ref_norms[-1]) / max(
                   abs(ref_norms[-1]), 1e-12),
               "final_weights_rel_l2_diff": rel_weight_diff(weights, ref_weights),
               "train_seconds": round(train_s, 3), "placement": place,
               "memory_ledger_MiB": {k: round(v / 2**20, 3) for k, v in mem["ledger"].items()},
               "accelerator_peak_MiB": round(mem["accelerator"]["peak"] / 2**20, 1),
               "config": cfg["zero_optimization"]}
    if zeropp is not None:
        numbers["zeropp"] = zeropp
    failures = []
    if not all(math.isfinite(v) for v in losses):
        failures.append(f"non-finite loss: {losses}")
    if curve > loss_tol:
        failures.append(f"loss curve differs from plain torch by {curve:.3g} relative "
                        f"(bound {loss_tol})")
    if not norm_diff <= norm_tol:
        failures.append(f"first step's gradient norm {norms[0]:.6g} vs torch "
                        f"{ref_norms[0]:.6g} ({norm_diff:.3g} relative, bound {norm_tol})")
    if place["unexpected_on_host_count"]:
        failures.append(f"{place['unexpected_on_host_count']} engine tensor(s) in host memory "
                        f"that belong on the device: {place['unexpected_on_host'][:3]}")
    if place["unexpected_on_device_count"]:
        failures.append(f"{place['unexpected_on_device_count']} offloaded tensor(s) on the "
                        f"device: {place['unexpected_on_device'][:3]}")
    if losses[-1] >= losses[0]:
        failures.append(f"the loss did not go down ({losses[0]:.4f} -> {losses[-1]:.4f})")
    detail = (f"loss {losses[0]:.3f}->{losses[-1]:.3f}, curve diff {curve:.2e}, "
              f"norm diff {norm_diff:.2e}, host MiB {place['host_MiB']}")
    if case.qwz or case.qgz:
        detail += "; world size 1: gathers/reductions are local copies, nothing is quantized"
    release_memory(ctx)
    return {"numbers": numbers, "failures": failures, "detail": detail}
