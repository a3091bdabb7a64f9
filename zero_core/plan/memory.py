"""Bytes per rank of one planned configuration: model states, offload, hpZ, activations,
buffers.

Model states are ``zero_core.memory.model_state_breakdown`` (ARCHITECTURE §4's formulas,
the ones ``engine.memory_report()`` prints) evaluated on the engine's own padded element
count: the layout comes from the engine's layout code (``plan_group_layout`` at stages 0–2,
``plan_units`` + ``unit_layout`` at stage 3 on the model's meta-device shape), so the
prediction is the memory ledger's figure, padding included, not a re-derivation.

Under MiCS (``mics_shard_size`` G) the model states are partitioned over a shard group of G
ranks and replicated across the N/G groups, so every figure here (layout and padding, model
states, offload, buffers) is plain ZeRO's at world size G: the planner passes G as the world
size (e.g. stage 3 mixed precision: 16Ψ/G instead of 16Ψ/N). Node-aware collectives change
how partitions travel, not what a rank holds.

Offload (``offload_optimizer`` cpu/nvme) moves the master weights and optimizer states off
the device, to host memory or to files on disk; at stage 3 ``offload_param`` moves the
parameter partition too. hpZ keeps a secondary partition of every non-persistent unit,
P/H elements of the compute dtype (H = ranks per node), as ``zeropp/hpz.py`` allocates.

Activations of a GPT block (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", §4.1, eq. 1, no tensor/sequence parallelism), for s tokens per
sample, micro-batch b, width h, a heads, 16-bit activations:

    per layer  s·b·h·(34 + 5·a·s/h) bytes

(34sbh: the inputs kept for the QKV, attention-output and MLP matmuls, LayerNorms, GELU and
dropout masks; 5as²b: the attention scores, softmax and its dropout mask). Attention that
never materializes the scores (flash / memory-efficient SDPA) drops the second term
(``flash_attention=True``). fp32 activations double the figure. With activation
checkpointing only each layer's input is kept, 2sbh per layer (16-bit), plus one layer's
full activations while it is recomputed. Both add the logits: s·b·V in the compute dtype
and again in fp32 for the loss (``lm_loss`` upcasts).

Buffers, in the engine's pools at steady state (B = the largest gradient bucket,
``reduce_bucket_size`` at most; b = bytes of the compute dtype; the counts were read off the
pools of 2-rank runs of the bench GPT, whose ledger they then matched exactly):

- stage 0 reduces inside its flat gradient buffer: nothing, except under bf16/fp16 one fp32
  copy of a bucket for the optimizer kernels (4B);
- stage 1: one reduce-scatter output and one all-gather send buffer of B/N each (2bB/N),
  plus the fp32 bucket slice under bf16/fp16 (4B/N);
- stage 2: two gradient buckets (2bB), the send buffer (bB/N), the fp32 slice (4B/N under
  bf16/fp16). The pool only grows while every buffer belongs to a bucket still filling, so
  the count is how many buckets receive gradients at once: 2 on the bench GPT (a
  parameter straddling two buckets), 3 on the tiny one with 4,000-element buckets
  (tests/test_plan.py) -- a lower bound where gradients arrive far out of bucket order;
- stage 3: one fp32 bucket for the reduction, plus the gathered parameters: the persistent
  unit (kept gathered) and the live window: the largest unit plus one prefetch bucket, or
  the units the forward leaves gathered for the backward if more, at most
  ``stage3_max_live_parameters``.

Offloaded optimizer (``placement``): the host store holds the fp32 master slice (the
parameters' own fp32 values at fp32: a copy) and the states, plus one fp32 gradient buffer
of a sub-group (``sub_group_size``, the whole partition by default). On nvme the host holds
instead ``buffer_count`` swap slots of one sub-group of the master and both moments, and at
stage 3 the parameter store's ``buffer_count`` staging buffers of ``buffer_size`` elements.
"""
from __future__ import annotations

from dataclasses import dataclass

from zero_core.config.schema import ZeroConfig
from zero_core.memory import PRECISION_BYTES, model_state_breakdown
from zero_core.partitioning.layout import alignment_for, plan_group_layout
from zero_core.plan.model import ModelSpec, PlanError
from zero_core.stage3.units import coalesce_numel, plan_units, unit_layout

ADAM_K = 12


@dataclass(frozen=True)
class ZeroSizes:
    """The zero_optimization sizes the layout and the offload buffers depend on
    (elements, counts). Defaults: the config parser's (``zero_core.config``), read by
    :func:`default_sizes`; a user's config by :func:`sizes_from_config`."""

    reduce_bucket_size: int
    prefetch_bucket_size: int
    persistence_threshold: int
    max_live_parameters: int
    sub_group_size: int = ZeroConfig.sub_group_size
    optimizer_buffer_count: int = 4   # offload_optimizer.buffer_count (nvme slots)
    param_buffer_count: int = 5       # offload_param.buffer_count (nvme staging buffers)
    param_buffer_size: int = 100_000_000
    max_reuse_distance: int = ZeroConfig.stage3_max_reuse_distance


def sizes_from_config(config: dict | None = None) -> ZeroSizes:
    """The sizes of a DeepSpeed-style *config* (dict), the parser's defaults for what it
    does not set (and for None)."""
    from zero_core.config import parse_config
    cfg = dict(config or {})
    # only the ZeRO sizes are read: the batch (elasticity's included, which may not allow
    # world size 1) does not matter here
    cfg.pop("elasticity", None)
    cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    zc = parse_config(cfg).zero_optimization
    return ZeroSizes(zc.reduce_bucket_size, zc.stage3_prefetch_bucket_size,
                     zc.stage3_param_persistence_threshold, zc.stage3_max_live_parameters,
                     zc.sub_group_size, zc.offload_optimizer.buffer_count,
                     zc.offload_param.buffer_count, zc.offload_param.buffer_size,
                     zc.stage3_max_reuse_distance)


def default_sizes() -> ZeroSizes:
    return sizes_from_config(None)


@dataclass(frozen=True)
class Layout:
    """The engine's flat layout of one model at one stage and world size: *padded* elements
    of trainable parameters, and at stage 3 every unit's (padded elements, persistent), in
    forward order, and how many of the last non-persistent ones the forward leaves gathered
    for the backward (:func:`kept_for_backward`)."""

    num_parameters: int
    padded: int
    units: tuple[tuple[int, bool], ...] = ()
    max_bucket: int = 0   # stages 0-2: the largest gradient bucket's elements
    kept_for_backward: int = 0

    def _gathered_split(self) -> tuple[list[int], list[int]]:
        """The non-persistent units' padded elements: (gathered again in backward, kept)."""
        gathered = [p for p, keep in self.units if not keep]
        cut = len(gathered) - self.kept_for_backward
        return gathered[:cut], gathered[cut:]

    @property
    def regathered(self) -> list[int]:
        """Padded elements of the units the backward gathers again (stage 3)."""
        return self._gathered_split()[0]

    @property
    def kept(self) -> list[int]:
        """Padded elements of the units the forward leaves gathered for the backward."""
        return self._gathered_split()[1]

    @property
    def padding(self) -> int:
        return self.padded - self.num_parameters


def kept_for_backward(units, sizes: ZeroSizes) -> int:
    """How many of the last non-persistent *units* (padded elements, persistent; forward
    order) stay gathered from the forward into the backward, by the coordinator's two rules
    (``stage3/coordinator.py``: reused within ``max_reuse_distance`` elements, or within the
    prefetcher's reach) for a model that requests each unit once in forward and once in
    backward, in reverse: after unit j's forward its next use comes after the later units'
    forward and backward requests, 2·S elements (S: the later units), and keeping it needs
    the live window to hold it with the later non-persistent units. Several requests per
    unit (one per module) or a tied weight change the counts: an estimate for those."""
    kept, later, later_live = 0, 0, 0
    for numel, persistent in reversed(units):
        if not persistent:
            in_window = later_live + numel <= sizes.max_live_parameters
            reused = 2 * later <= sizes.max_reuse_distance
            prefetched = (0 < sizes.prefetch_bucket_size
                          and 2 * later_live + numel <= sizes.prefetch_bucket_size)
            if not (in_window and (reused or prefetched)):
                break
            kept += 1
            later_live += numel
        later += numel
    return kept


def layout(spec: ModelSpec, stage: int, world_size: int, precision: str,
           sizes: ZeroSizes | None = None) -> Layout:
    """The engine's layout for *spec* (one optimizer group, every parameter trainable)."""
    sizes = sizes or default_sizes()
    model = spec.build_meta()
    params = list(model.parameters())
    psi = sum(p.numel() for p in params)
    align = alignment_for(PRECISION_BYTES[precision])
    if stage < 3:
        lay = plan_group_layout([p.numel() for p in reversed(params)], sizes.reduce_bucket_size,
                                world_size, align)
        return Layout(psi, lay.padded_numel, max_bucket=max(lay.bucket_sizes, default=0))
    target = coalesce_numel(sizes.prefetch_bucket_size, sizes.reduce_bucket_size)
    units, _ = plan_units(model, {id(p): 0 for p in params}, sizes.persistence_threshold, target)
    lay = unit_layout(units, world_size, align)
    shapes = tuple((u.padded_numel, u.persistent) for u in units)
    return Layout(psi, lay.padded_numel, shapes, kept_for_backward=kept_for_backward(shapes, sizes))


def model_states(stage: int, elements: float, world_size: int, precision: str,
                 k: int = ADAM_K) -> dict:
    """Bytes per rank by category (``model_state_breakdown``) plus ``model_states``, their sum."""
    out = model_state_breakdown(stage, elements, world_size, precision, k)
    out["model_states"] = sum(out.values())
    return out


def activation_bytes(spec: ModelSpec, micro_batch: int, precision: str,
                     checkpointing: bool = False, flash_attention: bool = False) -> dict:
    """Activation bytes per rank (module docstring: Korthikanti et al. 2022, eq. 1)."""
    s, b, h, a, layers = spec.seq, micro_batch, spec.hidden, spec.n_head, spec.n_layer
    scale = PRECISION_BYTES[precision] / 2
    per_layer = s * b * h * 34 + (0 if flash_attention else 5 * a * s * s * b)
    per_layer *= scale
    logits = s * b * spec.vocab * (PRECISION_BYTES[precision] + 4)
    if checkpointing:
        kept = layers * 2 * s * b * h * scale + per_layer
    else:
        kept = layers * per_layer
    return {"layers": kept, "logits": logits, "total": kept + logits,
            "formula": ("L·2sbh + sbh(34 + 5as/h)" if checkpointing else "L·sbh(34 + 5as/h)")
            + (" (no 5as/h: flash attention)" if flash_attention else "")
            + ("" if scale == 1 else f" ×{scale:g} ({precision})") + " + sbV(bytes + 4)"}


def buffer_bytes(lay: Layout, stage: int, precision: str, sizes: ZeroSizes,
                 world_size: int = 1) -> dict:
    """Working buffers per rank (module docstring)."""
    b = PRECISION_BYTES[precision]
    mixed = precision != "fp32"
    if stage < 3:
        big, part = lay.max_bucket, lay.max_bucket // world_size
        out = {"gradient_buckets": 2 * b * big if stage == 2 else 0,
               "reduce_scatter_output": b * part if stage == 1 else 0,
               "gather_send": b * part if stage else 0,
               "fp32_gradient": (4 * (big if stage == 0 else part)) if mixed else 0}
        out["total"] = sum(out.values())
        return out
    persistent = sum(p for p, keep in lay.units if keep)
    largest = max((p for p, keep in lay.units if not keep), default=0)
    window = min(max(largest + sizes.prefetch_bucket_size, sum(lay.kept)),
                 sizes.max_live_parameters,
                 lay.padded - persistent)
    out = {"reduce_bucket": 4 * min(sizes.reduce_bucket_size, lay.padded),
           "persistent_parameters": b * persistent, "live_parameters": b * max(window, 0)}
    out["total"] = sum(out.values())
    return out


OFFLOAD = ("none", "cpu", "nvme")


def placement(states: dict, stage: int, offload: str, partition_elements: float = 0.0,
              precision: str = "bf16", sizes: ZeroSizes | None = None) -> dict:
    """Where the model states live: bytes per rank on the device, in host memory and on
    disk, for *offload* none / cpu / nvme (optimizer; at stage 3 the parameters too).
    *partition_elements*: this rank's share of the parameters, for what the offloaded
    optimizer keeps in host memory besides the moved states (module docstring)."""
    if offload not in OFFLOAD:
        raise PlanError(f"offload {offload!r}: use one of {', '.join(OFFLOAD)}")
    if offload != "none" and stage < 1:
        raise PlanError("offload needs stage 1, 2 or 3 (it moves partitioned optimizer states)")
    sizes = sizes or default_sizes()
    moved = ["master_weights", "optimizer_states"] + (["parameters"] if stage == 3 else [])
    moved = moved if offload != "none" else []
    off = sum(states[c] for c in moved)
    host_extra = 0.0
    if offload != "none":
        # the fp32 gradient buffer of one sub-group, and at fp32 the master copy (at
        # bf16/fp16 the master is already among the moved states)
        sub_group = min(partition_elements, sizes.sub_group_size)
        host_extra = 4 * sub_group
        if precision == "fp32":
            host_extra += 4 * partition_elements
        if offload == "nvme":
            # the swap slots: each holds one sub-group of the master and Adam's two moments
            host_extra += sizes.optimizer_buffer_count * 3 * 4 * sub_group
            if stage == 3:   # the parameter store's staging buffers
                host_extra += (sizes.param_buffer_count * sizes.param_buffer_size
                               * PRECISION_BYTES[precision])
    return {"device": states["model_states"] - off,
            "host": (off if offload == "cpu" else 0.0) + host_extra,
            "disk": off if offload == "nvme" else 0.0,
            "moved": moved}


def hpz_bytes(lay: Layout, precision: str, hpz_size: int) -> float:
    """hpZ's secondary partition per rank: P/H compute-dtype elements per non-persistent unit."""
    return sum(p for p, keep in lay.units if not keep) * PRECISION_BYTES[precision] // hpz_size
