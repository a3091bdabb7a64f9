"""DeepSpeed's ``flops_profiler`` (0.19.8 semantics): at one optimizer step, rank 0 counts
the floating-point operations of the model's forward per module, times each module and the
step's phases, and prints (or writes to ``output_file``) a per-module profile with the
step's achieved FLOP/s and its MFU against a stated peak.

**When.** At the optimizer step whose number ``engine.global_steps`` equals
``profile_step`` (steps done before it, as DeepSpeed compares; 0 = the first step), on rank
0 only: every training forward of that step's micro-steps (``engine(...)`` in train mode
with autograd on; evaluation calls are not profiled), its backwards and its update. The
report comes when the update has run. With gradient accumulation the FLOPs and latencies
are sums over the step's micro-steps (DeepSpeed 0.19.8 re-profiles and prints at each
micro-step of that step instead). The hook is the wall-clock timers' place in the step
(engine/timers.py, ``WallClock.__call__``): at every other step, and on other ranks, the
profiler costs one comparison per phase, installs nothing and synchronizes nothing.

**Counting** is our own ``TorchDispatchMode`` (:class:`_Counting`) over the aten
operations the forward runs, with PyTorch's published formulas
(``torch.utils.flop_counter.flop_registry``: mm, addmm, bmm, baddbmm, convolutions, the
SDPA kernels; 2 FLOPs per multiply-add) plus the CPU's fused SDPA kernel
(``_scaled_dot_product_flash_attention_for_cpu``), which the registry lacks — on the CPU
``FlopCounterMode`` counts attention as 0. An operation without a formula is decomposed
where PyTorch can (as FlopCounterMode does). Why not FlopCounterMode itself: the module a
FLOP belongs to comes from our own forward hooks, the same ones that time each module
(they run after stage 3's gather hooks, so gathered parameters are in place), and tests
compare against FlopCounterMode as an independent attribution. Counted are the matrix
products, i.e. what accelerator peak figures measure; elementwise work (norms,
activations, softmax) is not, unlike DeepSpeed's patched functionals (a few per cent of a
GPT's forward). MACs are FLOPs / 2. Backward = 2 × forward FLOPs, plus
``recompute_fwd_factor`` × forward for activation checkpointing (DeepSpeed's rule):
``FLOPS per GPU = (3 + recompute_fwd_factor) × fwd FLOPs / (fwd + bwd + step latency)``.

**Parameters** per module are every parameter's full ``numel()``: at stage 3 a released
parameter answers with its full shape (stage3/partitioned_params.py), so the counts are the
model's, not this rank's partitions.

**Timing.** At the profiled step only, each module's forward is bracketed by device
synchronizations (as DeepSpeed's profiler does), and so are the step's fwd, bwd and step
phases; the per-module times include the hooks' synchronizations.

**Peak and MFU** (zero-core's addition). The peak per device, in this order: the config
key ``flops_profiler.peak_tflops`` (zero-core's own); a datasheet figure for the NVIDIA
data-centre GPUs of :data:`DATASHEET_TFLOPS` (dense, per compute dtype; fp32 means TF32
when torch allows TF32 matmuls); otherwise measured: the best of 3 square matmuls in the
compute dtype on this device (n = 1024 on the CPU, 4096 elsewhere), run after the profiled
step. The source is printed next to the figure. ``MFU = FLOPS per GPU / peak``.

The finished profile (a dict) is ``engine.wall_clock.flops.profile``.
"""
from __future__ import annotations

import os
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from zero_core.config.precision import dtype_name, torch_dtype

#: the phases of the step the profile times (DeepSpeed's fwd / bwd / step latencies)
TIMED = ("fwd", "bwd", "step")

_aten = torch.ops.aten
#: formulas: PyTorch's, plus the CPU's fused attention kernel (same arguments as SDPA's)
FORMULAS = dict(flop_registry)
if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu"):
    FORMULAS[_aten._scaled_dot_product_flash_attention_for_cpu] = \
        flop_registry[_aten._scaled_dot_product_flash_attention]

#: dense peak TFLOP/s per GPU from NVIDIA's datasheets: (name contains, {dtype: TFLOP/s});
#: "tf32" is fp32 with TF32 tensor cores allowed. First match wins (PCIe before the SXM name);
#: NVL boards (other clocks) are not in the table: measured, or set peak_tflops.
DATASHEET_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
)


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one aten call by the formulas above (0 for an operation without one)."""
    formula = FORMULAS.get(getattr(func, "_overloadpacket", None))
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


class _Counting(TorchDispatchMode):
    """Adds each counted operation's FLOPs to the modules whose forwards are running."""

    def __init__(self, profile: ForwardProfile):
        super().__init__()
        self.profile = profile

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (getattr(func, "_overloadpacket", None) not in FORMULAS
                and func is not torch.ops.prim.device.default):
            with self:  # a composite without a formula: count what it is made of
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        out = func(*args, **kwargs)
        flops = op_flops(func, args, kwargs, out)
        if flops:
            self.profile.add(flops)
        return out


class ModuleRecord:
    """One module's share of a profile: its parameters, FLOPs (its children's included, as
    DeepSpeed counts), forward seconds (inclusive), calls."""

    __slots__ = ("name", "cls", "depth", "params", "flops", "latency", "calls", "_t0")

    def __init__(self, name: str, module: torch.nn.Module):
        self.name, self.cls = name, type(module).__name__
        self.depth = name.count(".") + 1 if name else 0
        self.params = sum(p.numel() for p in module.parameters())
        self.flops, self.latency, self.calls, self._t0 = 0, 0.0, 0, []

    @property
    def macs(self) -> int:
        return self.flops // 2

    def as_dict(self) -> dict:
        return {"class": self.cls, "depth": self.depth, "params": self.params,
                "flops": self.flops, "macs": self.macs, "latency_s": self.latency,
                "calls": self.calls}


class ForwardProfile:
    """Forward hooks on every module of *model* plus the counting mode: ``with
    profile.counting(): model(x)`` counts and times that forward; FLOPs run outside every
    module of the model go to ``outside``. ``remove()`` takes the hooks off. Usable on
    its own (tests): ``ForwardProfile(model).records`` maps module names to records."""

    def __init__(self, model: torch.nn.Module, synchronize=None):
        self._sync = synchronize or (lambda: None)
        self.records: dict[str, ModuleRecord] = {}
        self._stack: list[ModuleRecord] = []
        self._on = False
        self.outside = 0
        self._handles = []
        for name, module in model.named_modules():
            rec = self.records[name] = ModuleRecord(name, module)
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(rec)))
            self._handles.append(module.register_forward_hook(self._post_hook(rec),
                                                              always_call=True))

    def _pre_hook(self, rec: ModuleRecord):
        def pre(module, args):
            if self._on:
                self._sync()
                rec._t0.append(time.perf_counter())
                self._stack.append(rec)
        return pre

    def _post_hook(self, rec: ModuleRecord):
        def post(module, args, output):
            if self._on and rec._t0:
                self._sync()
                rec.latency += time.perf_counter() - rec._t0.pop()
                rec.calls += 1
                self._stack.pop()
        return post

    def add(self, flops: int) -> None:
        if not self._stack:
            self.outside += flops
        for rec in {id(r): r for r in self._stack}.values():  # once per module on the stack
            rec.flops += flops

    def counting(self):
        return _CountingForward(self)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class _CountingForward:
    def __init__(self, profile: ForwardProfile):
        self.profile, self.mode = profile, _Counting(profile)

    def __enter__(self):
        self.profile._on = True
        self.mode.__enter__()
        return self.profile

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.profile._on = False
        self.profile._stack.clear()
        return False


class _ProfiledPhase:
    """A timed phase of the profiled step, around the wall clock's own (or its null one)."""

    def __init__(self, profiler: FlopsProfiler, name: str, inner):
        self.profiler, self.name, self.inner = profiler, name, inner

    def __enter__(self):
        self.inner.__enter__()
        p = self.profiler
        self.steps0 = p.engine.global_steps
        self.counting = p.forward_profile().counting() if self.name == "fwd" else None
        p.sync()
        self.t0 = time.perf_counter()
        if self.counting is not None:
            self.counting.__enter__()

    def __exit__(self, exc_type, exc, tb):
        p = self.profiler
        try:
            if self.counting is not None:
                self.counting.__exit__(exc_type, exc, tb)
            p.sync()
            p.seconds[self.name] += time.perf_counter() - self.t0
            if self.name == "fwd":
                p.micro_steps += 1
            if exc_type is not None:
                p.abandon()
            elif self.name == "step" and p.engine.global_steps != self.steps0:
                p.finish()
        finally:
            self.inner.__exit__(exc_type, exc, tb)
        return False


class FlopsProfiler:
    """The engine's profiler (rank 0, ``flops_profiler.enabled``), ``engine.wall_clock.flops``."""

    def __init__(self, engine, cfg):
        self.engine, self.cfg = engine, cfg
        self.done = False
        self.profile: dict | None = None
        self.seconds = dict.fromkeys(TIMED, 0.0)
        self.micro_steps = 0
        self._forward: ForwardProfile | None = None

    def sync(self) -> None:
        self.engine.runtime.accelerator.synchronize()

    def due(self) -> bool:
        return not self.done and self.engine.global_steps == self.cfg.profile_step

    def phase(self, name: str, inner):
        """The context phase *name* runs in at the profiled step (*inner*: the wall clock's)."""
        if name not in TIMED or (name == "fwd" and not (self.engine.module.training
                                                        and torch.is_grad_enabled())):
            return inner
        return _ProfiledPhase(self, name, inner)

    def forward_profile(self) -> ForwardProfile:
        if self._forward is None:
            self._forward = ForwardProfile(self.engine.module, self.sync)
        return self._forward

    def abandon(self) -> None:
        """A phase of the profiled step raised: take the hooks off, report nothing."""
        if self._forward is not None:
            self._forward.remove()
        self.done = True

    def finish(self) -> None:
        fwd = self.forward_profile()
        fwd.remove()
        self.done = True
        self.profile = build_profile(self.engine, self.cfg, fwd, self.seconds, self.micro_steps)
        text = render(self.profile, self.cfg)
        if self.cfg.output_file:
            write_atomically(self.cfg.output_file, text)
            print(f"[Rank 0] flops profile of step {self.profile['step']} written to "
                  f"{self.cfg.output_file}", flush=True)
        else:
            print(text, end="", flush=True)


def build_profiler(engine) -> FlopsProfiler | None:
    """The profiler on rank 0 when ``flops_profiler.enabled``; None otherwise."""
    cfg = engine.config.flops_profiler
    if not cfg.enabled or engine.global_rank != 0:
        return None
    return FlopsProfiler(engine, cfg)


def matmul_dtype(engine) -> torch.dtype:
    """The dtype the forward's matrix products run in: torch_autocast's when it is on
    (null: torch's default for the device), else the compute dtype."""
    ac = engine.config.torch_autocast
    if not ac.enabled:
        return engine.compute_dtype
    if ac.dtype is None:
        return torch.get_autocast_dtype(engine.device.type)
    return torch_dtype(ac.dtype)


# ---- the peak ----------------------------------------------------------------------------------
def peak_tflops(device: torch.device, dtype: torch.dtype, configured: float | None = None
                ) -> tuple[float, str]:
    """Peak dense TFLOP/s of one *device* in *dtype*, and where the figure comes from."""
    if configured is not None:
        return configured, "config flops_profiler.peak_tflops"
    name = dtype_name(dtype)
    if device.type == "cuda" and name in ("fp32", "bf16", "fp16"):
        gpu = torch.cuda.get_device_name(device)
        if name == "fp32" and torch.get_float32_matmul_precision() != "highest":
            name = "tf32"
        for pattern, table in DATASHEET_TFLOPS:
            if pattern in gpu and "NVL" not in gpu:
                return table[name], f"datasheet, {gpu}, dense {name}"
    return measure_matmul_tflops(device, dtype)


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None,
                          repeats: int = 3) -> tuple[float, str]:
    """The best of *repeats* timed n x n matmuls (after one warm-up) in TFLOP/s."""
    n = n or (1024 if device.type == "cpu" else 4096)
    sync = (torch.cuda.synchronize if device.type == "cuda" else
            getattr(getattr(torch, device.type, None), "synchronize", lambda: None))
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    a @ b
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e12, f"measured: best of {repeats} {n}x{n} matmuls"


# ---- the report --------------------------------------------------------------------------------
def build_profile(engine, cfg, fwd: ForwardProfile, seconds: dict, micro_steps: int) -> dict:
    root = fwd.records[""]
    flops = root.flops + fwd.outside
    factor = 3.0 + cfg.recompute_fwd_factor         # forward + 2x backward + recompute
    it = seconds["fwd"] + seconds["bwd"] + seconds["step"]
    achieved = factor * flops / it if it > 0 else 0.0
    dtype = matmul_dtype(engine)
    peak, source = peak_tflops(engine.device, dtype, cfg.peak_tflops)
    return {
        "step": engine.global_steps - 1, "micro_steps": micro_steps,
        "world_size": engine.world_size, "stage": engine.stage,
        "micro_batch_per_gpu": engine.config.train_micro_batch_size_per_gpu,
        "samples": engine.config.train_batch_size, "dtype": dtype_name(dtype),
        "params": root.params, "fwd_flops": flops, "fwd_macs": flops // 2,
        "fwd_s": seconds["fwd"], "bwd_s": seconds["bwd"], "step_s": seconds["step"],
        "iter_s": it, "flops_factor": factor, "achieved_flops": achieved,
        "peak_tflops": peak, "peak_source": source,
        "mfu": achieved / (peak * 1e12) if peak > 0 else 0.0,
        "modules": _rolled_up(fwd.records),
    }


def _rolled_up(records: dict[str, ModuleRecord]) -> dict[str, dict]:
    """Each record as a dict; a container never called itself (a ModuleList) gets the sum of
    its children's FLOPs and latency, as DeepSpeed reports it."""
    out = {name: r.as_dict() for name, r in records.items()}
    children: dict[str, list[dict]] = {}
    for name in out:
        if name:
            children.setdefault(name.rpartition(".")[0], []).append(out[name])
    for name in sorted(out, key=lambda n: -out[n]["depth"]):   # deepest first
        m = out[name]
        if m["calls"] == 0 and name:
            kids = children.get(name, [])
            m["flops"] = sum(k["flops"] for k in kids)
            m["macs"], m["latency_s"] = m["flops"] // 2, sum(k["latency_s"] for k in kids)
    return out


def _si(x: float, unit: str = "", digits: int = 2) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.{digits}f} {prefix}{unit}"
    if float(x).is_integer():
        return f"{int(x)} {unit}".rstrip()
    return f"{x:.{digits}f} {unit}".rstrip()


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0%"


def render(p: dict, cfg) -> str:
    """The profile as text: summary, top modules per depth, the per-module tree."""
    line = "{:<72}  {}".format
    f, fac = p["fwd_flops"], p["flops_factor"]
    bwd_fac = fac - 1
    out = ["", "-------------------------- zero-core Flops Profiler (DeepSpeed's "
               "flops_profiler) --------------------------",
           f"Profile Summary at step {p['step']} ({p['micro_steps']} profiled forward(s) "
           f"summed; ZeRO stage {p['stage']}, {p['dtype']}):",
           "FLOPs count matrix products (mm, bmm, convolutions, attention), 2 per "
           "multiply-add; bwd = 2 x fwd (+ recompute_fwd_factor x fwd)", "",
           line("world size:", p["world_size"]),
           line("data parallel size:", p["world_size"]),
           line("batch size per GPU:", p["micro_batch_per_gpu"]),
           line("params of model (full sizes, also at stage 3):", _si(p["params"])),
           line("fwd MACs per GPU:", _si(p["fwd_macs"], "MACs")),
           line("fwd flops per GPU:", _si(f)),
           line("fwd latency:", _ms(p["fwd_s"])),
           line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency:",
                _si(f / p["fwd_s"] if p["fwd_s"] else 0, "FLOPS")),
           line("bwd latency:", _ms(p["bwd_s"])),
           line(f"bwd FLOPS per GPU = {bwd_fac:g} * fwd flops per GPU / bwd latency:",
                _si(bwd_fac * f / p["bwd_s"] if p["bwd_s"] else 0, "FLOPS")),
           line(f"fwd+bwd FLOPS per GPU = {fac:g} * fwd flops per GPU / (fwd+bwd latency):",
                _si(fac * f / (p["fwd_s"] + p["bwd_s"]) if p["fwd_s"] + p["bwd_s"] else 0,
                    "FLOPS")),
           line("step latency:", _ms(p["step_s"])),
           line("iter latency:", _ms(p["iter_s"])),
           line(f"FLOPS per GPU = {fac:g} * fwd flops per GPU / iter latency:",
                _si(p["achieved_flops"], "FLOPS")),
           line("samples/second:", f"{p['samples'] / p['iter_s']:.2f}" if p["iter_s"] else 0),
           line(f"peak FLOPS per GPU ({p['peak_source']}):",
                _si(p["peak_tflops"] * 1e12, "FLOPS")),
           line("MFU = FLOPS per GPU / peak FLOPS per GPU:", f"{100 * p['mfu']:.2f}%")]
    mods = p["modules"]
    max_depth = max(m["depth"] for m in mods.values())
    depth = max_depth if cfg.module_depth < 0 else min(cfg.module_depth, max_depth)
    out += ["", "----------------------------- Aggregated Profile per GPU "
                "-----------------------------",
            f"Top {cfg.top_modules} modules in terms of params, MACs or fwd latency at "
            f"different model depths:"]
    for d in range(depth + 1):
        by_cls: dict[str, list] = {}
        for m in mods.values():
            if m["depth"] == d:
                agg = by_cls.setdefault(m["class"], [0, 0, 0.0])
                agg[0] += m["macs"]
                agg[1] += m["params"]
                agg[2] += m["latency_s"]
        top = {k: sorted(by_cls.items(), key=lambda kv, i=i: kv[1][i], reverse=True)
               [:cfg.top_modules] for i, k in enumerate(("macs", "params", "latency"))}
        out += [f"depth {d}:",
                "    params      - {" + ", ".join(f"'{c}': '{_si(v[1])}'"
                                                  for c, v in top["params"]) + "}",
                "    MACs        - {" + ", ".join(f"'{c}': '{_si(v[0], 'MACs')}'"
                                                  for c, v in top["macs"]) + "}",
                "    fwd latency - {" + ", ".join(f"'{c}': '{_ms(v[2])}'"
                                                  for c, v in top["latency"]) + "}"]
    if cfg.detailed:
        root = mods[""]
        out += ["", "------------------------------ Detailed Profile per GPU "
                    "------------------------------",
                "Each module: params, % of total params, MACs, % of total MACs, fwd latency, "
                "% of total fwd latency, fwd FLOPS (children included)"]
        for name, m in mods.items():
            if m["depth"] > depth:
                continue
            flops_s = m["flops"] / m["latency_s"] if m["latency_s"] else 0
            out.append("  " * m["depth"] + f"({name or 'model'}): {m['class']}("
                       f"{_si(m['params'])} = {_pct(m['params'], root['params'])} Params, "
                       f"{_si(m['macs'], 'MACs')} = {_pct(m['macs'], root['macs'])} MACs, "
                       f"{_ms(m['latency_s'])} = {_pct(m['latency_s'], root['latency_s'])} "
                       f"latency, {_si(flops_s, 'FLOPS')})")
    out.append("-" * 78)
    return "\n".join(out) + "\n"


def write_atomically(path: str, text: str) -> None:
    """Write *text* to *path* through a temporary file in the same directory and a rename:
    a reader sees the old file or the whole new one."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".flops-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
