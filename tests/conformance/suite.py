"""Running the whole suite on every rank: set-up, control plane, merging, the table."""
from __future__ import annotations

import importlib
import secrets
from dataclasses import dataclass, field

import torch

from .accel_checks import AcceleratorChecks
from .comm_checks import CommChecks
from .results import FAIL, Abort, CheckResult, Recorder, counts, format_table, merge


@dataclass
class SuiteReport:
    """What one rank knows after the suite: the merged verdict of every check."""

    comm: str
    accelerator: str
    rank: int
    world_size: int
    ranks_per_node: int
    seed: int
    results: list[CheckResult]                      # merged over ranks
    local: list[CheckResult] = field(default_factory=list)  # this rank's own
    aborted: str = ""
    not_available: dict = field(default_factory=dict)  # accelerator -> why it was not checked

    @property
    def ok(self) -> bool:
        return not self.aborted and all(r.status != FAIL for r in self.results)

    def table(self) -> str:
        head = (f"zero-core conformance: comm={self.comm} accelerator={self.accelerator} "
                f"ranks={self.world_size} ({self.world_size // self.ranks_per_node} node(s) x "
                f"{self.ranks_per_node}) seed={self.seed}")
        text = format_table(self.results, head)
        for name, why in sorted(self.not_available.items()):
            text += f"\naccelerator {name} not checked: not available here ({why})"
        if self.aborted:
            text += f"\nABORTED: {self.aborted}"
        return text

    def to_json(self) -> dict:
        return {"comm": self.comm, "accelerator": self.accelerator, "rank": self.rank,
                "world_size": self.world_size, "ranks_per_node": self.ranks_per_node,
                "seed": self.seed, "ok": self.ok, "aborted": self.aborted,
                "counts": counts(self.results),
                "results": {r.name: {"status": r.status, "detail": r.detail} for r in self.results},
                "not_available": self.not_available}


# ---- control plane: torch.distributed, independent of the communicator under test --------
def _dist():
    import torch.distributed as dist
    return dist


def agree(flag: bool) -> list[bool]:
    """Every rank's *flag*, in rank order."""
    dist = _dist()
    mine = torch.tensor([int(bool(flag))], dtype=torch.int64)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [bool(t.item()) for t in out]


def sync() -> None:
    _dist().barrier()


def shared_seed(seed: int | None) -> int:
    """Rank 0's seed (fresh unless given), the same on every rank."""
    dist = _dist()
    value = torch.tensor([seed if seed is not None else secrets.randbelow(2**31)], dtype=torch.int64)
    dist.broadcast(value, src=0)
    return int(value.item())


def gather_results(local: list[CheckResult]) -> list[list[dict]]:
    dist = _dist()
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, [r.to_json() for r in local])
    return out


# ---- the entry points -------------------------------------------------------------------
def load_plugins(modules) -> None:
    """Register plugin modules given by import name, on top of the installed entry points
    (to test a plugin before it is packaged)."""
    from zero_core.runtime import registry
    mods = [importlib.import_module(m) if isinstance(m, str) else m for m in modules]
    if mods:
        # registry.load() does not cache a view with in-process extras (tests use those
        # privately); here they are meant to be this process's plugins, so that
        # init_distributed() selects from them: install the view as the cached registry.
        registry._REGISTRY = registry.load(refresh=True, extra_modules=mods)


def run_conformance(comm: str | None = None, accelerator: str | None = None, *,
                    plugins=(), ranks_per_node: int | None = None, seed: int | None = None,
                    timeout: float = 60.0, select=(), check_comm: bool = True,
                    check_accelerators: bool = True, verbose: bool = True) -> SuiteReport:
    """Run the conformance suite on this rank (call it on every rank of the job).

    *comm* / *accelerator*: names as in the config (None: the usual selection — environment,
    then auto-detection). *plugins*: extra plugin modules to register. *ranks_per_node*:
    topology override (as ``ZERO_CORE_RANKS_PER_NODE``). *seed*: reuse a run's seed to
    reproduce it (default: fresh). *timeout*: collective timeout in seconds. *select*:
    substrings of check names to run (default: all). Prints the table on rank 0 when
    *verbose*; returns the merged report (``report.ok`` is the verdict).
    """
    from zero_core.runtime import registry
    from zero_core.runtime.context import init_distributed

    load_plugins(plugins)
    rt = init_distributed(accelerator=accelerator, comm_backend=comm, timeout=timeout,
                          ranks_per_node=ranks_per_node)
    run_seed = shared_seed(seed)
    rec = Recorder(select=select, agree=agree)
    reg = registry.load()
    not_available = {}
    aborted = ""
    try:
        if check_comm:
            CommChecks(rt.comm, run_seed, rec, agree, sync, ranks_per_node, rt.device).run_all()
        if check_accelerators:
            for name, contrib in sorted(reg.accelerators.items()):
                ok, why = contrib.obj.availability()
                if not ok:
                    not_available[name] = why
                    continue
                acc = rt.accelerator if name == rt.accelerator.name else contrib.obj()
                AcceleratorChecks(acc, reg, rec, rt.launch.local_rank).run_all()
    except Abort as exc:
        aborted = str(exc)
    try:
        merged = merge(gather_results(rec.results))
    except Exception as exc:  # noqa: BLE001 - the control plane died with the backend
        merged = rec.results
        aborted = aborted or f"could not gather results from the other ranks: {exc}"
    report = SuiteReport(comm=rt.comm.name, accelerator=rt.accelerator.name, rank=rt.rank,
                         world_size=rt.world_size, ranks_per_node=rt.topology.ranks_per_node,
                         seed=run_seed, results=merged, local=rec.results,
                         aborted=aborted, not_available=not_available)
    if verbose and (rt.rank == 0 or aborted):
        print(report.table(), flush=True)
    return report
