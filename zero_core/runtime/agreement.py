"""Ranks that must agree, checked once at ``initialize``: config, world, model, versions.

Ranks configured differently do not fail on their own: stage 2 on one rank and stage 3 on
the other hang in different collectives until the communicator times out; stage 1 against
stage 2, or fp32 against bf16, train without a word and give wrong results. So before the
engine's first collective every rank describes, in a few JSON parts, what must be the same
everywhere (:func:`describe`), and one all-gather of one 8-byte digest per part shows whether
they are. Only when a digest differs are the parts themselves exchanged, and every rank
raises the same :class:`RankDisagreementError` naming the ranks and the differing values
(the same text on every rank, so that the failure report prints it once per job).

Parts compared: ``versions`` (zero-core, torch, Python), ``world`` (world size, ranks per
node, accelerator, communicator), ``config`` (after defaults: ``Config.to_dict``),
``model`` (parameter names, shapes, dtypes, requires_grad, in order) and ``optimizer``
(a client optimizer's class and hyperparameters). Parameter *values* are checked later by
``engine/model_sync.check_parameters_match``, which needs agreeing shapes first.
"""
from __future__ import annotations

import hashlib
import json
import platform

import torch

from zero_core.errors import ZeroCoreError
from zero_core.interfaces.communicator import all_gather_bytes
from zero_core.version import __version__

__all__ = ["RankDisagreementError", "describe", "check_ranks_agree", "disagreements"]

PARTS = ("versions", "world", "config", "model", "optimizer")
_SHOWN = 6  # differing entries named in the message; the rest are counted


class RankDisagreementError(ZeroCoreError):
    """Ranks were started with different configs, models or versions."""


def describe(runtime, cfg, model: torch.nn.Module, optimizer=None) -> dict:
    """What this rank must share with every other one, as JSON-able data per part."""
    opt = None
    if optimizer is not None and hasattr(optimizer, "param_groups"):
        opt = {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
               "groups": [{k: v for k, v in g.items() if k != "params"}
                          for g in optimizer.param_groups]}
    elif optimizer is not None:  # a factory: params -> optimizer
        opt = {"callable": getattr(optimizer, "__qualname__", type(optimizer).__name__)}
    return {
        "versions": {"zero_core": __version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "world": {"world_size": runtime.world_size,
                  "ranks_per_node": runtime.topology.ranks_per_node,
                  "accelerator": runtime.accelerator.name, "communicator": runtime.comm.name},
        "config": cfg.to_dict(),
        "model": [[name, list(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad]
                  for name, p in model.named_parameters()],
        "optimizer": opt,
    }


def _encode(value) -> bytes:
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":")).encode()


def _digest(data: bytes) -> int:
    """A signed 64-bit integer (what an int64 tensor holds) from the SHA-256 of *data*."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True)


def check_ranks_agree(runtime, cfg, model: torch.nn.Module, optimizer=None) -> None:
    """Collective: raise :class:`RankDisagreementError` on every rank unless every rank's
    :func:`describe` is the same. One all-gather of ``len(PARTS)`` int64 when they agree."""
    comm = runtime.comm
    if comm.world_size == 1:
        return
    parts = describe(runtime, cfg, model, optimizer)
    encoded = {name: _encode(parts[name]) for name in PARTS}
    mine = torch.tensor([_digest(encoded[name]) for name in PARTS], dtype=torch.int64)
    everyone = torch.empty(comm.world_size * len(PARTS), dtype=torch.int64)
    comm.all_gather_into(everyone, mine)
    table = everyone.view(comm.world_size, len(PARTS))
    differing = [name for j, name in enumerate(PARTS) if bool((table[:, j] != table[0, j]).any())]
    if not differing:
        return
    # the failure path only: every rank exchanges the differing parts in full
    payload = _encode({name: parts[name] for name in differing})
    gathered = [json.loads(b) for b in all_gather_bytes(comm, payload)]
    lines = disagreements({name: [g[name] for g in gathered] for name in differing})
    raise RankDisagreementError(
        "ranks disagree on what they were started with (checked at initialize; the job "
        "would hang or train wrongly otherwise):\n  " + "\n  ".join(lines) + "\nStart every "
        "rank with the same script, config, model and software (one environment for all "
        "nodes). To skip this check: config \"safety\": {\"check_ranks_agree\": false}")


def disagreements(per_rank: dict) -> list[str]:
    """Readable lines for ``{part: [value on rank 0, value on rank 1, ...]}`` (the parts
    that differ), each naming the differing entry and which ranks hold which value."""
    lines = []
    for part, values in per_rank.items():
        if part == "model":
            lines += _model_lines(values)
            continue
        flat = [_flatten(v) for v in values]
        keys = sorted(set().union(*flat), key=str)
        diff = [k for k in keys if len({_encode(f.get(k, "<absent>")) for f in flat}) > 1]
        for k in diff[:_SHOWN]:
            label = f"{part} {k}" if part != "config" else f"config key '{k}'"
            lines.append(f"{label}: {_by_rank([f.get(k, '<absent>') for f in flat])}")
        if len(diff) > _SHOWN:
            lines.append(f"... and {len(diff) - _SHOWN} more {part} entries differ")
    return lines


def _model_lines(values: list) -> list[str]:
    counts = {len(v) for v in values}
    if len(counts) > 1:
        return [f"model: number of parameters {_by_rank([len(v) for v in values])}"]
    for i, entries in enumerate(zip(*values)):
        if len({_encode(e) for e in entries}) > 1:
            shown = [{"name": e[0], "shape": e[1], "dtype": e[2], "requires_grad": e[3]}
                     for e in entries]
            return [f"model: parameter #{i}: {_by_rank(shown)}"]
    return ["model: parameters differ"]


def _flatten(value, prefix: str = "") -> dict:
    """``{"a.b": leaf}`` for nested dicts (lists are leaves)."""
    if not isinstance(value, dict):
        return {prefix or "value": value}
    out = {}
    for k, v in value.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flatten(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def _by_rank(values: list) -> str:
    """``2 on ranks 0, 2; 3 on rank 1`` — ranks grouped by value, in rank order."""
    groups: dict[bytes, list[int]] = {}
    shown: dict[bytes, object] = {}
    for r, v in enumerate(values):
        key = _encode(v)
        groups.setdefault(key, []).append(r)
        shown.setdefault(key, v)
    parts = []
    for key, ranks in groups.items():
        where = (f"rank {ranks[0]}" if len(ranks) == 1 else
                 f"ranks {_ranks_text(ranks)}")
        parts.append(f"{json.dumps(shown[key], default=str)} on {where}")
    return "; ".join(parts)


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 8:
        return f"{', '.join(map(str, ranks[:8]))}, ... ({len(ranks)} ranks)"
    return ", ".join(map(str, ranks))
