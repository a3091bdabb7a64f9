"""DeepSpeed's ``elasticity`` section: one global batch for a range of world sizes.

With ``"elasticity": {"enabled": true, "max_train_batch_size": B, "micro_batch_sizes": [...],
...}`` the config no longer gives the batch triple. It is computed, as DeepSpeed computes it
(``deepspeed/elasticity/elasticity.py``, last shipped in DeepSpeed 0.19.7; 0.19.8 removed
elastic training and refuses the section), into

* one global batch ``train_batch_size``, the same for every world size in
* the list of valid world sizes (data-parallel ranks), and, for the world size the config is
  resolved for,
* the micro batch per rank: the largest of ``micro_batch_sizes`` that divides
  ``train_batch_size / world_size``, and so ``gradient_accumulation_steps = train_batch_size /
  (micro × world_size)``.

A job restarted on fewer (or more) ranks from the valid list therefore keeps its global batch;
only the accumulation (and perhaps the micro batch) changes.

How the global batch is chosen (``version`` 0.1):

1. Bases: each micro batch size and their least common multiple. A base above
   ``max_train_batch_size`` is dropped; a base equal to it is a candidate as is; any other base
   is scaled by the largest highly composite number (from :data:`HCN_LIST`, DeepSpeed's 38)
   that keeps it at or below ``max_train_batch_size``.
2. For each candidate batch, the valid world sizes are the numbers ``n`` in ``[min_gpus,
   max_gpus]`` that divide ``batch / m`` for some micro batch size ``m`` dividing the batch.
3. The candidate with the most valid world sizes wins; on a tie the larger batch
   (``prefer_larger_batch``, default true) or the smaller one.

``version`` 0.2 (DeepSpeed's default when ``version`` is absent) works per node: with ``g =
num_gpus_per_node`` it runs 0.1 with ``max_train_batch_size / g``, ``min_gpus / g`` and
``max_gpus / g`` (each truncated to an integer; 0 means "no bound", as in DeepSpeed), then
multiplies the batch and the valid world sizes by ``g``. With ``num_gpus_per_node`` 1 it gives
the same result as 0.1.

What zero-core does where DeepSpeed differs or cannot apply:

* ``enabled`` false (or absent, DeepSpeed's default): the section has no effect; its key names
  are still checked (a misspelt key is an error with a "did you mean", another unknown key a
  warning, as DeepSpeed reads the section key by key), its values are not read, as DeepSpeed
  does not read them.
* ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps``
  given next to an enabled section are refused, naming the key and the elastic value
  (DeepSpeed's rule); with ``ignore_non_elastic_batch_info`` true the elastic values win, with
  a :class:`~zero_core.errors.ConfigWarning` for each given value they replace.
* A world size outside the valid list is a :class:`~zero_core.errors.ConfigError` naming the
  nearest valid sizes. (Version 0.1 in DeepSpeed refuses it too. Version 0.2 in DeepSpeed
  instead trains that world size with a *different* global batch, the largest — or smallest —
  multiple of ``micro × world_size`` up to ``max_train_batch_size``; zero-core refuses, since
  keeping the global batch is the point of the section, and the message names the batch
  DeepSpeed would have used.)
* ``model_parallel_size`` > 1 is refused by name: zero-core is data parallel only.
* ``min_time`` is a hint to the resource scheduler: accepted without effect (``NO_EFFECT_KEYS``).
  ``num_gpus_per_node`` has no effect with version 0.1, as in DeepSpeed.
* ``DEEPSPEED_ELASTICITY_CONFIG`` in the environment (the elastic config the resource scheduler
  planned with) must agree with the section on ``max_train_batch_size``,
  ``micro_batch_sizes`` and ``version``, as DeepSpeed requires.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from zero_core.config.checks import _as_bool, _as_int, _fail, _Section
from zero_core.errors import ConfigError, ConfigWarning

__all__ = ["ElasticitySettings", "ElasticPlan", "HCN_LIST", "parse_elasticity", "elastic_plan",
           "candidate_batch_sizes", "valid_world_sizes", "elastic_batch", "SCHEDULER_ENV"]

# The 38 smallest highly composite numbers (DeepSpeed's list; enough for batches up to ~720K
# times a micro batch).
HCN_LIST = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520,
            5040, 7560, 10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880,
            166320, 221760, 277200, 332640, 498960, 554400, 665280, 720720)

VERSIONS = (0.1, 0.2)
SCHEDULER_ENV = "DEEPSPEED_ELASTICITY_CONFIG"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class ElasticitySettings:
    """An enabled ``elasticity`` section, validated (DeepSpeed's defaults for absent keys)."""

    max_train_batch_size: int
    micro_batch_sizes: tuple[int, ...]
    min_gpus: int = 1
    max_gpus: int = 10000
    prefer_larger_batch: bool = True
    ignore_non_elastic_batch_info: bool = False
    version: float = 0.2
    num_gpus_per_node: int = 1
    model_parallel_size: int = 1


@dataclass(frozen=True)
class ElasticPlan:
    """The world-size independent result: the global batch and the world sizes that train it."""

    train_batch_size: int
    valid_world_sizes: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]

    def micro_batch(self, world_size: int) -> int | None:
        """The largest micro batch size dividing the per-rank share (None: world size invalid)."""
        if world_size not in self.valid_world_sizes:
            return None
        share = self.train_batch_size // world_size
        return next((m for m in sorted(set(self.micro_batch_sizes), reverse=True)
                     if share % m == 0), None)

    def batch(self, world_size: int) -> tuple[int, int, int] | None:
        """(train_batch_size, micro batch, accumulation steps) for *world_size*, or None."""
        micro = self.micro_batch(world_size)
        if micro is None:
            return None
        return self.train_batch_size, micro, self.train_batch_size // (micro * world_size)


# ---------------------------------------------------------------------------------------------
# Parsing.
# ---------------------------------------------------------------------------------------------

def _micro_batch_sizes(path: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise _fail(path, value, f"expected a list of micro batch sizes, e.g. [{value!r}]")
    if not isinstance(value, (list, tuple)) or not value:
        raise _fail(path, value, "expected a non-empty list of integers >= 1 (the micro batch "
                                 "sizes per rank the job may train with)")
    return tuple(_as_int(f"{path}[{i}]", v, 1) for i, v in enumerate(value))


def _version(path: str, value: Any) -> float:
    try:
        number = float(value)  # DeepSpeed compares float(version); "0.1" is 0.1 there too
    except (TypeError, ValueError):
        number = None
    if isinstance(value, bool) or number not in VERSIONS:
        raise _fail(path, value, "expected 0.1 or 0.2 (DeepSpeed's elasticity versions; 0.2 "
                                 "is the default)")
    return number


def parse_elasticity(raw: Any) -> ElasticitySettings | None:
    """The ``elasticity`` section: None when absent or not enabled (its key names checked),
    else the validated settings. Refuses model parallelism by name."""
    if raw is None:
        return None
    s = _Section(raw, "elasticity", "elasticity")
    if not s.get("enabled", False, _as_bool):
        return None
    for key in ("max_train_batch_size", "micro_batch_sizes"):
        if not s.has(key):
            raise ConfigError(f"config key 'elasticity.{key}' is missing: an enabled elasticity "
                              f"section needs max_train_batch_size (the largest global batch "
                              f"acceptable) and micro_batch_sizes (a list of micro batch sizes "
                              f"per rank)")
    cfg = ElasticitySettings(
        max_train_batch_size=s.get("max_train_batch_size", None, _as_int, 1),
        micro_batch_sizes=s.get("micro_batch_sizes", None, _micro_batch_sizes),
        min_gpus=s.get("min_gpus", 1, _as_int, 1),
        max_gpus=s.get("max_gpus", 10000, _as_int, 1),
        prefer_larger_batch=s.get("prefer_larger_batch", True, _as_bool),
        ignore_non_elastic_batch_info=s.get("ignore_non_elastic_batch_info", False, _as_bool),
        version=s.get("version", 0.2, _version),
        num_gpus_per_node=s.get("num_gpus_per_node", 1, _as_int, 1),
        model_parallel_size=s.get("model_parallel_size", 1, _as_int, 1))
    if cfg.max_gpus < cfg.min_gpus:
        raise _fail("elasticity.max_gpus", cfg.max_gpus,
                    f"must be >= elasticity.min_gpus = {cfg.min_gpus}")
    if cfg.model_parallel_size > 1:
        raise _fail("elasticity.model_parallel_size", cfg.model_parallel_size,
                    "elastic training with model parallelism is not implemented in zero-core "
                    "(it is data parallel only); set it to 1")
    too_big = [m for m in cfg.micro_batch_sizes if m > cfg.max_train_batch_size]
    if too_big:
        raise _fail("elasticity.micro_batch_sizes", list(cfg.micro_batch_sizes),
                    f"{', '.join(map(str, too_big))} exceed max_train_batch_size = "
                    f"{cfg.max_train_batch_size}; every micro batch size must be at most it")
    return cfg


# ---------------------------------------------------------------------------------------------
# The batch plan (DeepSpeed's algorithm).
# ---------------------------------------------------------------------------------------------

def candidate_batch_sizes(bases, max_batch: int) -> list[int]:
    """Each base (at most *max_batch*) scaled by the largest HCN keeping it <= *max_batch*."""
    out = set()
    for base in bases:
        if base > max_batch:
            continue
        if base == max_batch:
            out.add(base)
            continue
        limit = max_batch // base
        out.add(base * max(h for h in HCN_LIST if h <= limit))
    return sorted(out)


def _divisors(n: int) -> list[int]:
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def valid_world_sizes(batch: int, micro_batches, lo: int, hi: int) -> list[int]:
    """World sizes in [lo, hi] that split *batch* into equal whole micro-batches of one of
    *micro_batches* per rank."""
    sizes = set()
    for m in set(micro_batches):
        if batch % m == 0:
            sizes.update(n for n in _divisors(batch // m) if lo <= n <= hi)
    return sorted(sizes)


def _plan_v01(micro_batches, max_batch: int, min_gpus: int, max_gpus: int,
              prefer_larger: bool) -> tuple[int, list[int]]:
    # 0 means "no bound" (v0.2 truncates per-node bounds, which can reach 0)
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_batch // min(micro_batches)
    bases = list(micro_batches) + [math.lcm(*micro_batches)]
    best: tuple[int, int] | None = None  # (number of valid sizes, ±batch)
    chosen, sizes = 0, []
    for batch in candidate_batch_sizes(bases, max_batch):
        valid = valid_world_sizes(batch, micro_batches, min_gpus, max_gpus)
        key = (len(valid), batch if prefer_larger else -batch)
        if valid and (best is None or key > best):
            best, chosen, sizes = key, batch, valid
    return chosen, sizes


def elastic_plan(cfg: ElasticitySettings) -> ElasticPlan:
    """The global batch and the valid world sizes of *cfg* (version 0.1 or 0.2)."""
    micro = cfg.micro_batch_sizes
    if cfg.version == 0.1:
        batch, sizes = _plan_v01(micro, cfg.max_train_batch_size, cfg.min_gpus, cfg.max_gpus,
                                 cfg.prefer_larger_batch)
        where = f"[{cfg.min_gpus}, {cfg.max_gpus}]"
    else:
        per_node = cfg.num_gpus_per_node // cfg.model_parallel_size
        node_max = int(cfg.max_train_batch_size / per_node)
        too_big = [m for m in micro if m > node_max]
        if too_big:
            raise _fail("elasticity.micro_batch_sizes", list(micro),
                        f"{', '.join(map(str, too_big))} exceed max_train_batch_size / "
                        f"num_gpus_per_node = {cfg.max_train_batch_size} / "
                        f"{cfg.num_gpus_per_node} = {node_max} (version 0.2 plans per node)")
        batch, nodes = _plan_v01(micro, node_max, int(cfg.min_gpus / cfg.num_gpus_per_node),
                                 int(cfg.max_gpus / cfg.num_gpus_per_node),
                                 cfg.prefer_larger_batch)
        batch, sizes = batch * per_node, [n * per_node for n in nodes]
        where = (f"[{cfg.min_gpus}, {cfg.max_gpus}] in whole nodes of num_gpus_per_node = "
                 f"{cfg.num_gpus_per_node}")
    if not sizes:
        raise _fail("elasticity", {"max_train_batch_size": cfg.max_train_batch_size,
                                   "micro_batch_sizes": list(micro)},
                    f"no world size in {where} can train one global batch of at most "
                    f"max_train_batch_size with these micro batch sizes; lower min_gpus or "
                    f"raise max_train_batch_size")
    return ElasticPlan(train_batch_size=batch, valid_world_sizes=tuple(sizes),
                       micro_batch_sizes=micro)


def _deepspeed_v02_fallback(cfg: ElasticitySettings, world_size: int) -> int:
    """The global batch DeepSpeed's version 0.2 trains a world size outside its list with."""
    batches = [math.floor(cfg.max_train_batch_size / float(m * world_size)) * m * world_size
               for m in cfg.micro_batch_sizes]
    return max(batches) if cfg.prefer_larger_batch else min(batches)


def _nearest(sizes, world_size: int) -> str:
    below = [n for n in sizes if n < world_size]
    above = [n for n in sizes if n > world_size]
    near = ([below[-1]] if below else []) + ([above[0]] if above else [])
    if len(near) == 1:
        return f"the nearest valid world size is {near[0]}"
    return f"the nearest valid world sizes are {near[0]} and {near[1]}"


def world_size_error(cfg: ElasticitySettings, plan: ElasticPlan, world_size: int) -> ConfigError:
    sizes = plan.valid_world_sizes
    listing = (", ".join(map(str, sizes)) if len(sizes) <= 24 else
               f"{', '.join(map(str, sizes[:12]))}, … {sizes[-1]}; {len(sizes)} sizes")
    text = (f"elasticity: world size {world_size} cannot train the elastic global batch "
            f"{plan.train_batch_size} (train_batch_size for every valid world size) with a "
            f"micro batch from micro_batch_sizes {list(cfg.micro_batch_sizes)}; "
            f"{_nearest(sizes, world_size)} (valid: {listing})")
    if cfg.version == 0.2:
        text += (f". DeepSpeed's version 0.2 would instead train this world size with another "
                 f"global batch ({_deepspeed_v02_fallback(cfg, world_size)}); zero-core keeps "
                 f"one global batch, so run on a valid world size")
    return ConfigError(text)


def check_scheduler_config(cfg: ElasticitySettings, scheduler_json: str | None) -> None:
    """DeepSpeed's check that the resource scheduler planned with the same elastic config
    (*scheduler_json*: the ``DEEPSPEED_ELASTICITY_CONFIG`` environment variable, or None)."""
    if scheduler_json is None:
        return
    try:
        planned = json.loads(scheduler_json)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{SCHEDULER_ENV} (the elastic config of the resource scheduler) is "
                          f"not valid JSON: {exc.msg}") from None
    if not isinstance(planned, Mapping):
        raise ConfigError(f"{SCHEDULER_ENV} must hold a JSON object (the elasticity section "
                          f"the resource scheduler planned with), not {planned!r}")
    # DeepSpeed's defaults for what the scheduler's section leaves out
    theirs = {"max_train_batch_size": planned.get("max_train_batch_size", 2000),
              "micro_batch_sizes": list(planned.get("micro_batch_sizes", [2, 4, 6])),
              "version": planned.get("version", 0.2)}
    ours = {"max_train_batch_size": cfg.max_train_batch_size,
            "micro_batch_sizes": list(cfg.micro_batch_sizes), "version": cfg.version}
    for key, value in ours.items():
        other = theirs[key]
        if key == "version":
            try:
                same = not isinstance(other, bool) and float(other) == value
            except (TypeError, ValueError):
                same = False
        else:
            same = other == value
        if not same:
            raise ConfigError(f"config key 'elasticity.{key}' = {value!r} differs from the "
                              f"resource scheduler's {other!r} ({SCHEDULER_ENV}); the job "
                              f"would be scaled to world sizes planned for another batch — "
                              f"make the two configs agree")


# ---------------------------------------------------------------------------------------------
# The hook of parse_config.
# ---------------------------------------------------------------------------------------------

def elastic_batch(top: _Section, world_size: int,
                  environ: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """(train_batch_size, micro batch, accumulation steps) for *world_size* when the config
    *top* (the top-level section) enables elasticity; None when it does not."""
    cfg = parse_elasticity(top.raw.get("elasticity"))
    if cfg is None:
        return None
    environ = os.environ if environ is None else environ
    check_scheduler_config(cfg, environ.get(SCHEDULER_ENV))
    plan = elastic_plan(cfg)
    resolved = plan.batch(world_size)
    if resolved is None:
        raise world_size_error(cfg, plan, world_size)
    for key, value in zip(BATCH_KEYS, resolved):
        if key not in top.raw:
            continue
        given = top.raw[key]
        if not cfg.ignore_non_elastic_batch_info:
            raise _fail(key, given,
                        f"given together with an enabled 'elasticity' section, which sets "
                        f"train_batch_size, train_micro_batch_size_per_gpu and "
                        f"gradient_accumulation_steps itself ({resolved[0]}, {resolved[1]} "
                        f"and {resolved[2]} at world size {world_size}); remove {key}, or set "
                        f"elasticity.ignore_non_elastic_batch_info true to have the elastic "
                        f"value override it")
        if given != value:
            warnings.warn(f"config key '{key}' = {given!r} is overridden by elasticity: "
                          f"{value} at world size {world_size} "
                          f"(elasticity.ignore_non_elastic_batch_info is true)",
                          ConfigWarning, stacklevel=3)
    return resolved
