"""Running checks, collecting their outcomes, and merging them across ranks.

A check is a function of a :class:`Check` context. It records soft failures with
``expect``/``fail`` and keeps going, so that every rank issues the same collectives in the
same order even when one rank sees a wrong value (a rank that stopped early would leave
its peers waiting in a collective). It raises :class:`Unsupported` or :class:`NotApplicable`
to end early on every rank alike.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass, field

PASS, FAIL, UNSUPPORTED, SKIP = "pass", "FAIL", "unsupported", "skip"


class Unsupported(Exception):
    """The backend declared this combination unsupported and refused it properly."""


class NotApplicable(Exception):
    """The check cannot apply to this job (e.g. it needs two ranks); reported as skip."""


class Abort(Exception):
    """The communicator may be in an unknown state (a timeout, ranks that disagreed):
    stop running checks."""


@dataclass
class CheckResult:
    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Check:
    """What a check function gets: where to put its findings."""

    name: str
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def expect(self, condition: bool, message: str) -> bool:
        """Record *message* as a failure unless *condition*; returns *condition*."""
        if not condition:
            self.failures.append(message)
        return bool(condition)

    def fail(self, message: str | None) -> None:
        """Record *message* as a failure (None: nothing to record, for compare_* helpers)."""
        if message:
            self.failures.append(message)

    def note(self, message: str) -> None:
        """Something worth showing even when the check passes (each once)."""
        if message not in self.notes:
            self.notes.append(message)


class Recorder:
    """Runs checks in order and keeps their local (this rank's) results.

    *select*: substrings; a check runs only if its name contains one of them (all run when
    empty). *agree*: called after every check with whether this rank raised unexpectedly;
    returns the flags of all ranks (the suite passes a torch.distributed exchange).
    """

    def __init__(self, select=(), agree=None):
        self.select = tuple(s for s in select if s)
        self.results: list[CheckResult] = []
        self._agree = agree

    def wants(self, name: str) -> bool:
        return not self.select or any(s in name for s in self.select)

    def run(self, name: str, fn, *args) -> CheckResult | None:
        """Run ``fn(check, *args)`` as the check *name* (if selected) and record it."""
        if not self.wants(name):
            return None
        check = Check(name)
        start = time.perf_counter()
        raised = None
        try:
            fn(check, *args)
            status = FAIL if check.failures else PASS
            detail = "; ".join(check.failures or check.notes)
        except Unsupported as exc:
            status, detail = (FAIL, "; ".join(check.failures)) if check.failures else (UNSUPPORTED, str(exc))
        except NotApplicable as exc:
            status, detail = SKIP, str(exc)
        except Exception as exc:  # an unexpected error is a failure of the backend
            raised = exc
            where = traceback.extract_tb(exc.__traceback__)[-1]
            status = FAIL
            detail = "; ".join(check.failures + [
                f"raised {type(exc).__name__}: {exc} (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})"])
        result = CheckResult(name, status, detail, time.perf_counter() - start)
        self.results.append(result)
        if isinstance(raised, TimeoutError):
            raise Abort(f"{name}: {raised}")
        if self._agree is not None:
            flags = self._agree(raised is not None)
            if any(flags) and not all(flags):
                raise Abort(f"after {name}: ranks {[r for r, f in enumerate(flags) if f]} raised "
                            f"and the others did not, so the communicator's peers may be out "
                            f"of step; stopping here")
        return result


def merge(per_rank: list[list[dict]]) -> list[CheckResult]:
    """One result per check from every rank's results (``to_json`` dicts, rank order).

    A check passes only if it passed on every rank; it is unsupported / skipped only if
    every rank said so; any other mix is a failure (ranks must agree on what a backend
    supports, or collectives would hang).
    """
    names: list[str] = []
    by_name: dict[str, dict[int, dict]] = {}
    for rank, results in enumerate(per_rank):
        for r in results:
            if r["name"] not in by_name:
                names.append(r["name"])
                by_name[r["name"]] = {}
            by_name[r["name"]][rank] = r
    merged = []
    nranks = len(per_rank)
    for name in names:
        ranks = by_name[name]
        statuses = {r["status"] for r in ranks.values()}
        seconds = max(r["seconds"] for r in ranks.values())
        missing = [k for k in range(nranks) if k not in ranks]
        if missing:
            merged.append(CheckResult(name, FAIL, f"did not run on ranks {missing}", seconds))
        elif statuses == {PASS}:
            # notes are informative only: show the first rank's that has one
            note = next((ranks[k]["detail"] for k in sorted(ranks) if ranks[k]["detail"]), "")
            merged.append(CheckResult(name, PASS, note, seconds))
        elif len(statuses) == 1 and statuses <= {UNSUPPORTED, SKIP}:
            merged.append(CheckResult(name, statuses.pop(), ranks[0]["detail"], seconds))
        else:
            merged.append(CheckResult(name, FAIL, _failure_detail(ranks), seconds))
    return merged


def _failure_detail(ranks: dict[int, dict]) -> str:
    """'rank 0,2: why; rank 1: other reason', grouping ranks that said the same."""
    by_text: dict[str, list[int]] = {}
    for rank, r in sorted(ranks.items()):
        if r["status"] == PASS:
            continue
        text = r["detail"] if r["status"] == FAIL else f"{r['status']}: {r['detail']}"
        by_text.setdefault(text, []).append(rank)
    return "; ".join(f"rank {','.join(map(str, rs))}: {text}" for text, rs in by_text.items())


def counts(results: list[CheckResult]) -> dict[str, int]:
    out = {PASS: 0, FAIL: 0, UNSUPPORTED: 0, SKIP: 0}
    for r in results:
        out[r.status] += 1
    return out


def format_table(results: list[CheckResult], header: str, width: int = 100) -> str:
    """A fixed-width pass/fail table, one line per check, details wrapped below failures."""
    name_w = max([len(r.name) for r in results] + [5])
    lines = [header, f"{'check':<{name_w}}  {'status':<11}  {'time':>7}  detail",
             "-" * min(width + name_w, 160)]
    for r in results:
        detail = r.detail if len(r.detail) <= width or r.status == FAIL else r.detail[:width - 3] + "..."
        lines.append(f"{r.name:<{name_w}}  {r.status:<11}  {r.seconds:6.2f}s  {detail}")
    c = counts(results)
    lines.append("-" * min(width + name_w, 160))
    lines.append(f"conformance: {c[PASS]} passed, {c[FAIL]} failed, {c[UNSUPPORTED]} unsupported, "
                 f"{c[SKIP]} skipped")
    return "\n".join(lines)
