"""Checks of a :class:`~zero_core.interfaces.communicator.Communicator`, run on every rank at once.

Every rank calls the same checks in the same order (the collectives inside them must
match up). Values are compared with references each rank computes from every rank's
seeded input (``data.py``); every call also has its ledger entry checked against the
table of ``zero_core/ledger.py``.
"""
from __future__ import annotations

import os
import time

import torch

from zero_core.errors import CommError
from zero_core.interfaces.ledger import CommLedger

from .data import (DTYPES, compare_exact, compare_reduction, expected_sent_bytes, rank_input)
from .results import Check, NotApplicable, Recorder, Unsupported

REDUCE_OPS = ("sum", "avg", "max", "min")
#: elements per rank (per chunk for reduce_scatter / all_to_all): a tiny odd size and one
#: that crosses a 4 KiB page in every dtype, without being a power of two
SIZES = (7, 1031)
#: how late one rank enters the async timing check, seconds
LATE_S = 1.0
#: how late one rank enters a barrier, seconds
BARRIER_LATE_S = 0.4


def poison(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer full of a value no input has, so unwritten elements show up."""
    if dtype.is_floating_point:
        return torch.full((numel,), float("nan"), dtype=dtype)
    return torch.full((numel,), torch.iinfo(dtype).min if torch.iinfo(dtype).min < 0 else 255,
                      dtype=dtype)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommChecks:
    """The communicator checks of one run. *agree(flag) -> [flag of each rank]* and
    *sync()* are the suite's control plane (torch.distributed, independent of *comm*)."""

    def __init__(self, comm, seed: int, recorder: Recorder, agree, sync,
                 ranks_per_node: int | None = None, device: torch.device | None = None):
        self.comm, self.seed, self.rec = comm, seed, recorder
        # the collectives run on the job's device (a communicator without transport for it
        # stages through host buffers); results are compared on the host
        self.device = torch.device(device or "cpu")
        self.agree, self.sync = agree, sync
        self.n, self.rank = comm.world_size, comm.rank
        self.rpn = self._expected_ranks_per_node(ranks_per_node)
        self._groups: dict = {}

    # ---- what the topology should be, from the launcher and the override ----------------
    def _expected_ranks_per_node(self, override):
        if override:
            return int(override)
        env = os.environ.get("ZERO_CORE_RANKS_PER_NODE")
        if env:
            return int(env)
        return min(self.comm.launch.local_world_size, self.n)

    def spans(self, ranks) -> bool:
        return len({r // self.rpn for r in ranks}) > 1

    # ---- helpers ---------------------------------------------------------------------
    def dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def inputs(self, tag, group, numel, dtype):
        """Every group member's input for *tag*, in group order."""
        return [rank_input(self.seed, tag, r, numel, dtype, group.size) for r in group.ranks]

    def measured(self, check: Check, op, group, payload: torch.Tensor | None, call, is_source=False):
        """Run *call* (one collective whose input is *payload*; None for a barrier) and
        check its ledger entry; returns what *call* returned."""
        before = self.comm.ledger.snapshot()
        out = call()
        diff = CommLedger.difference(self.comm.ledger.snapshot(), before)
        size = nbytes(payload) if payload is not None else 0
        elem = payload.element_size() if payload is not None else 0
        self.verify_ledger(check, diff, op, group, size, elem, is_source)
        return out

    def verify_ledger(self, check, diff, op, group, payload, elem, is_source):
        where = f"ledger for {op} on '{group.name}' (size {group.size})"
        calls = sum(d["calls"] for d in diff["ops"].values())
        if not check.expect(calls == 1, f"{where}: {calls} entries recorded "
                                        f"({sorted(diff['ops'])}), expected 1"):
            return
        (wire_op, d), = diff["ops"].items()
        if wire_op == op:
            # a backend may pad the payload to a multiple of the group size (fewer than n
            # extra elements) and must then count the padding it really sends
            pad = d["payload_bytes"] - payload
            check.expect(pad == 0 or 0 < pad < group.size * elem,
                         f"{where}: payload {d['payload_bytes']} B, expected {payload} B"
                         + (f" (+ padding of fewer than {group.size} elements)" if elem else ""))
            if pad > 0:
                check.note(f"{op} padded by {pad} B")
        else:  # the backend declared it carried the collective as another one
            check.note(f"{op} carried as {wire_op}")
            # whatever carries it, the data of the original collective must go out: a
            # substitute may not be counted as less than the original's bytes
            floor = expected_sent_bytes(op, group.size, payload, is_source)
            substitute = expected_sent_bytes(wire_op, group.size, d["payload_bytes"], is_source)
            check.expect(substitute >= floor,
                         f"{where}: carried as {wire_op} of {d['payload_bytes']} B, which counts "
                         f"{substitute} B sent, less than the {floor} B the {op} itself needs")
        want = expected_sent_bytes(wire_op, group.size, d["payload_bytes"], is_source)
        check.expect(d["sent_bytes"] == want,
                     f"{where}: sent {d['sent_bytes']} B, expected {want} B by the ledger table")
        spans = self.spans(group.ranks)
        check.expect(group.spans_nodes == spans,
                     f"group '{group.name}' {list(group.ranks)}: spans_nodes={group.spans_nodes}, "
                     f"expected {spans} with {self.rpn} ranks per node")
        check.expect((d["inter_node_bytes"], d["intra_node_bytes"]) == ((want, 0) if spans else (0, want)),
                     f"{where}: inter/intra = {d['inter_node_bytes']}/{d['intra_node_bytes']} B, "
                     f"expected all {want} B {'inter' if spans else 'intra'}-node")

    def refused(self, check: Check, what: str, words, call) -> None:
        """*call* must raise CommError mentioning *words*, and record nothing."""
        before = self.comm.ledger.snapshot()
        try:
            call()
        except CommError as exc:
            msg = str(exc)
            missing = [w for w in words if w.lower() not in msg.lower()]
            check.expect(not missing, f"{what}: the CommError message {msg!r} does not mention {missing}")
        except Exception as exc:  # noqa: BLE001 - any other type is the finding
            check.fail(f"{what}: raised {type(exc).__name__} ({exc}) instead of CommError")
        else:
            check.fail(f"{what}: was accepted, expected a CommError")
        check.expect(self.comm.ledger.snapshot() == before,
                     f"{what}: the refused call was recorded in the ledger")

    def integer_average(self, check, name, op, dtype, group, call):
        """Run *call*; for op="avg" on integers, a clean CommError refusal (nothing sent or
        recorded, the communicator still working) is also acceptable: the interface does
        not fix how the mean of integers rounds, so a backend may decline it."""
        if op != "avg" or dtype.is_floating_point:
            return call()
        before = self.comm.ledger.snapshot()
        try:
            return call()
        except CommError as exc:
            check.expect(self.comm.ledger.snapshot() == before,
                         f"{name}: the refused integer average was recorded in the ledger")
            self.still_works(check, f"refusing {name} avg on {dtype}", group)
            raise Unsupported(f"refuses op='avg' on {dtype} with CommError: {exc}") from None

    def still_works(self, check: Check, tag: str, group=None) -> None:
        """An fp32 all-reduce on *group* (the world) still gives the right answer."""
        g = group or self.comm.world
        ins = self.inputs(f"still_works/{tag}", g, 5, torch.float32)
        t = ins[g.rank].clone()
        self.comm.all_reduce(t, "sum", group=g)
        err = compare_reduction(t, ins, "sum")
        check.expect(err is None, f"after {tag}: the next all_reduce was wrong: {err}")

    def valid_call(self, op, dtype, group):
        """A well-formed call of *op* on *dtype* (for checking refusals)."""
        c, n = 3, group.size
        t = lambda k: torch.zeros(k, dtype=dtype)  # noqa: E731
        return {
            "all_gather_into": lambda: self.comm.all_gather_into(t(c * n), t(c), group=group),
            "reduce_scatter": lambda: self.comm.reduce_scatter(t(c), t(c * n), "sum", group=group),
            "all_reduce": lambda: self.comm.all_reduce(t(c), "sum", group=group),
            "all_to_all_single": lambda: self.comm.all_to_all_single(t(c * n), t(c * n), group=group),
            "broadcast": lambda: self.comm.broadcast(t(c), 0, group=group),
        }[op]

    def require_support(self, check: Check, op: str, dname: str, group) -> None:
        """Return if the backend carries *dtype* for *op*; otherwise check that it refuses
        it cleanly on every rank and raise Unsupported."""
        dtype = DTYPES[dname]
        supported = bool(self.comm.supports(op, dtype))
        # the control plane spans the world: only world-group checks can ask every rank
        flags = self.agree(supported) if group is self.comm.world else [supported]
        if len(set(flags)) > 1:
            check.fail(f"ranks disagree on supports({op!r}, {dtype}): {flags}")
            raise NotApplicable("ranks disagree")
        if supported:
            return
        self.refused(check, f"{op} on unsupported {dtype}", [op, str(dtype).replace("torch.", "")],
                     self.valid_call(op, dtype, group))
        self.still_works(check, f"refusing {op} on {dtype}", group)
        raise Unsupported(f"supports({op!r}, {dtype}) is False; refused with CommError "
                          f"before sending")

    # ---- collectives on the world, every dtype -------------------------------------------
    def all_gather(self, check, dname, group=None):
        g = group or self.comm.world
        self.require_support(check, "all_gather_into", dname, g)
        dtype = DTYPES[dname]
        for numel in SIZES:
            ins = self.inputs(f"all_gather/{dname}/{numel}", g, numel, dtype)
            out, mine = self.dev(poison(numel * g.size, dtype)), self.dev(ins[g.rank])
            self.measured(check, "all_gather_into", g, mine,
                          lambda: self.comm.all_gather_into(out, mine, group=g))
            err = compare_exact(out.cpu(), torch.cat(ins))
            check.expect(err is None, f"{numel} per rank: {err}")

    def reduce_scatter(self, check, dname, op, group=None):
        g = group or self.comm.world
        self.require_support(check, "reduce_scatter", dname, g)
        dtype = DTYPES[dname]
        for numel in SIZES:
            ins = self.inputs(f"reduce_scatter/{dname}/{op}/{numel}", g, numel * g.size, dtype)
            out, mine = self.dev(poison(numel, dtype)), self.dev(ins[g.rank])
            self.integer_average(check, "reduce_scatter", op, dtype, g, lambda: self.measured(
                check, "reduce_scatter", g, mine,
                lambda: self.comm.reduce_scatter(out, mine, op, group=g)))
            lo, hi = g.rank * numel, (g.rank + 1) * numel
            err = compare_reduction(out.cpu(), [t[lo:hi] for t in ins], op)
            check.expect(err is None, f"{numel} per chunk: {err}")

    def all_reduce(self, check, dname, op, group=None):
        g = group or self.comm.world
        self.require_support(check, "all_reduce", dname, g)
        dtype = DTYPES[dname]
        for numel in SIZES:
            ins = self.inputs(f"all_reduce/{dname}/{op}/{numel}", g, numel, dtype)
            t = self.dev(ins[g.rank].clone())
            self.integer_average(check, "all_reduce", op, dtype, g, lambda: self.measured(
                check, "all_reduce", g, t, lambda: self.comm.all_reduce(t, op, group=g)))
            err = compare_reduction(t.cpu(), ins, op)
            check.expect(err is None, f"{numel} elements: {err}")

    def all_to_all(self, check, dname, group=None):
        g = group or self.comm.world
        self.require_support(check, "all_to_all_single", dname, g)
        dtype = DTYPES[dname]
        for numel in SIZES:
            ins = self.inputs(f"all_to_all/{dname}/{numel}", g, numel * g.size, dtype)
            out, mine = self.dev(poison(numel * g.size, dtype)), self.dev(ins[g.rank])
            self.measured(check, "all_to_all_single", g, mine,
                          lambda: self.comm.all_to_all_single(out, mine, group=g))
            lo, hi = g.rank * numel, (g.rank + 1) * numel
            err = compare_exact(out.cpu(), torch.cat([t[lo:hi] for t in ins]))
            check.expect(err is None, f"{numel} per chunk: {err}")

    def broadcast(self, check, dname, group=None):
        g = group or self.comm.world
        self.require_support(check, "broadcast", dname, g)
        dtype = DTYPES[dname]
        for src in range(g.size):
            for numel in SIZES:
                ins = self.inputs(f"broadcast/{dname}/{src}/{numel}", g, numel, dtype)
                t = self.dev(ins[g.rank].clone())
                self.measured(check, "broadcast", g, t,
                              lambda: self.comm.broadcast(t, src, group=g), is_source=g.rank == src)
                err = compare_exact(t.cpu(), ins[src])
                check.expect(err is None, f"src {src}, {numel} elements: {err}")

    def barrier(self, check, group=None):
        """The barrier must hold every rank until the last one arrives."""
        g = group or self.comm.world
        self.sync()  # world-wide: every rank calls barrier() once per check, in some group
        if g.size < 2:
            self.measured(check, "barrier", g, None, lambda: self.comm.barrier(group=g))
            return
        late = g.ranks[-1]
        start = time.perf_counter()
        if self.rank == late:
            time.sleep(BARRIER_LATE_S)
        self.measured(check, "barrier", g, None, lambda: self.comm.barrier(group=g))
        waited = time.perf_counter() - start
        if self.rank != late:
            # a barrier that does not block returns in microseconds; the margin absorbs a
            # loaded machine's scheduling delays between the ranks' start lines
            check.expect(waited >= BARRIER_LATE_S / 4,
                         f"barrier returned after {waited:.3f} s although rank {late} entered "
                         f"{BARRIER_LATE_S:g} s late")

    # ---- refusals -----------------------------------------------------------------------
    def errors(self, check, case):
        g, n = self.comm.world, self.comm.world_size
        f32 = lambda k: torch.zeros(k)  # noqa: E731
        if case == "uneven_sizes":
            self.refused(check, "all_gather_into with an output one element short", ["all_gather_into"],
                         lambda: self.comm.all_gather_into(f32(4 * n - 1), f32(4)))
            self.refused(check, "reduce_scatter with an input one element long", ["reduce_scatter"],
                         lambda: self.comm.reduce_scatter(f32(4), f32(4 * n + 1)))
            self.refused(check, "all_to_all_single with input and output of different sizes",
                         ["all_to_all_single"],
                         lambda: self.comm.all_to_all_single(f32(2 * n), f32(3 * n)))
            if n > 1:
                self.refused(check, "all_to_all_single with a size not divisible by the group",
                             ["all_to_all_single", "divisible"],
                             lambda: self.comm.all_to_all_single(f32(2 * n + 1), f32(2 * n + 1)))
        elif case == "non_contiguous":
            self.refused(check, "all_reduce on a transposed matrix", ["all_reduce", "contiguous"],
                         lambda: self.comm.all_reduce(torch.zeros(4, 3).t()))
            self.refused(check, "all_gather_into into a strided view", ["all_gather_into", "contiguous"],
                         lambda: self.comm.all_gather_into(f32(8 * n)[::2], f32(4)))
            self.refused(check, "broadcast of a strided view", ["broadcast", "contiguous"],
                         lambda: self.comm.broadcast(f32(8)[::2], 0))
        elif case == "mixed_dtypes":
            self.refused(check, "all_gather_into fp32 into bf16", ["all_gather_into", "dtype"],
                         lambda: self.comm.all_gather_into(torch.zeros(4 * n, dtype=torch.bfloat16), f32(4)))
            self.refused(check, "reduce_scatter fp16 into fp32", ["reduce_scatter", "dtype"],
                         lambda: self.comm.reduce_scatter(f32(4), torch.zeros(4 * n, dtype=torch.float16)))
            self.refused(check, "all_to_all_single int8 into uint8", ["all_to_all_single", "dtype"],
                         lambda: self.comm.all_to_all_single(torch.zeros(n, dtype=torch.uint8),
                                                             torch.zeros(n, dtype=torch.int8)))
        elif case == "src_out_of_range":
            for src in (n, -1, n + 5):
                self.refused(check, f"broadcast from src={src}", ["broadcast", f"src={src}"],
                             lambda src=src: self.comm.broadcast(f32(3), src))
        elif case == "bad_reduce_op":
            self.refused(check, "all_reduce with op 'prod'", ["all_reduce", "prod"],
                         lambda: self.comm.all_reduce(f32(3), "prod"))
            self.refused(check, "reduce_scatter with op 'mean'", ["reduce_scatter", "mean"],
                         lambda: self.comm.reduce_scatter(f32(1), f32(n), "mean"))
        elif case == "not_a_tensor":
            self.refused(check, "all_reduce of a list", ["all_reduce", "tensor"],
                         lambda: self.comm.all_reduce([1.0, 2.0]))
        elif case == "non_member":
            if n < 2:
                raise NotApplicable("needs at least 2 ranks")
            g0 = self.comm.new_group([0], name="conformance_only_rank0")
            if self.rank == 0:
                check.expect(g0.is_member and g0.rank == 0, f"rank 0 is not a member of {g0}")
                t = torch.arange(3.0)
                self.comm.all_reduce(t, group=g0)  # a group of one: the identity
                check.fail(compare_exact(t, torch.arange(3.0)))
            else:
                check.expect(not g0.is_member and g0.rank == -1, f"rank {self.rank} is a member of {g0}")
                for op, call in [
                    ("all_reduce", lambda: self.comm.all_reduce(f32(3), group=g0)),
                    ("all_gather_into", lambda: self.comm.all_gather_into(f32(3), f32(3), group=g0)),
                    ("broadcast", lambda: self.comm.broadcast(f32(3), 0, group=g0)),
                    ("barrier", lambda: self.comm.barrier(group=g0)),
                ]:
                    self.refused(check, f"{op} on a group without this rank", [op, "member"], call)
        elif case == "bad_groups":
            self.refused(check, "new_group with a rank outside the world", [str(n)],
                         lambda: self.comm.new_group([0, n]))
            self.refused(check, "new_group with a repeated rank", ["distinct"],
                         lambda: self.comm.new_group([0, 0]))
            self.refused(check, "split that leaves a rank out", ["every rank"],
                         lambda: self.comm.split([list(range(n - 1))] if n > 1 else [[]], "bad"))
        else:
            raise ValueError(case)
        self.still_works(check, case)

    # ---- async ------------------------------------------------------------------------
    def async_in_flight(self, check):
        """Five collectives in flight at once, waited in a rank-dependent order."""
        g, n, c = self.comm.world, self.n, 33
        f = torch.float32
        tag = "async_in_flight"
        ar_in = self.inputs(f"{tag}/ar", g, c, f)
        ag_in = self.inputs(f"{tag}/ag", g, c, f)
        rs_in = self.inputs(f"{tag}/rs", g, c * n, f)
        a2a_in = self.inputs(f"{tag}/a2a", g, c * n, f)
        bc_in = self.inputs(f"{tag}/bc", g, c, f)
        ar, ag_out, rs_out, a2a_out, bc = (ar_in[g.rank].clone(), poison(c * n, f), poison(c, f),
                                           poison(c * n, f), bc_in[g.rank].clone())
        handles = [
            self.comm.all_reduce(ar, "sum", async_op=True),
            self.comm.all_gather_into(ag_out, ag_in[g.rank].clone(), async_op=True),
            self.comm.reduce_scatter(rs_out, rs_in[g.rank].clone(), "max", async_op=True),
            self.comm.all_to_all_single(a2a_out, a2a_in[g.rank].clone(), async_op=True),
            self.comm.broadcast(bc, n - 1, async_op=True),
        ]
        for h in handles:
            if not check.expect(h is not None and callable(getattr(h, "wait", None)),
                                f"async_op=True returned {h!r}, not a handle with wait()"):
                return
        order = list(range(len(handles)))[::-1] if self.rank % 2 == 0 else [2, 4, 0, 3, 1]
        for i in order:
            handles[i].wait()
        check.expect(all(h.is_completed() for h in handles), "is_completed() is False after wait()")
        lo, hi = g.rank * c, (g.rank + 1) * c
        check.fail(_label("all_reduce", compare_reduction(ar, ar_in, "sum")))
        check.fail(_label("all_gather_into", compare_exact(ag_out, torch.cat(ag_in))))
        check.fail(_label("reduce_scatter", compare_reduction(rs_out, [t[lo:hi] for t in rs_in], "max")))
        check.fail(_label("all_to_all_single", compare_exact(a2a_out, torch.cat([t[lo:hi] for t in a2a_in]))))
        check.fail(_label("broadcast", compare_exact(bc, bc_in[n - 1])))
        for h in handles:
            h.wait()  # waiting twice is harmless

    def async_returns_early(self, check):
        """One rank enters LATE_S late; on the others each async call must return at once
        and wait() must block until the late rank has contributed."""
        if self.n < 2:
            raise NotApplicable("needs at least 2 ranks")
        g, n, c, late = self.comm.world, self.n, 17, 0
        f = torch.float32
        ar_in = self.inputs("async_early/ar", g, c, f)
        ag_in = self.inputs("async_early/ag", g, c, f)
        rs_in = self.inputs("async_early/rs", g, c * n, f)
        ar, ag_out, rs_out = ar_in[g.rank].clone(), poison(c * n, f), poison(c, f)
        calls = [("all_reduce", lambda: self.comm.all_reduce(ar, "sum", async_op=True)),
                 ("all_gather_into", lambda: self.comm.all_gather_into(ag_out, ag_in[g.rank].clone(), async_op=True)),
                 ("reduce_scatter", lambda: self.comm.reduce_scatter(rs_out, rs_in[g.rank].clone(), "sum", async_op=True))]
        self.sync()
        if self.rank == late:
            time.sleep(LATE_S)
        t0 = time.perf_counter()
        handles, took = [], []
        for _, call in calls:
            t = time.perf_counter()
            handles.append(call())
            took.append(time.perf_counter() - t)
        done_early = [h.is_completed() for h in handles]
        for h in handles:
            h.wait()
        t_total = time.perf_counter() - t0
        if self.rank != late:
            for (op, _), dt, early in zip(calls, took, done_early):
                check.expect(dt < LATE_S / 2,
                             f"the async {op} call took {dt:.3f} s to return while rank {late} "
                             f"entered {LATE_S:g} s late: it does not return before the "
                             f"collective completes")
                check.expect(not early, f"{op}: is_completed() was True before the late rank entered")
            check.expect(t_total >= LATE_S / 2,
                         f"wait() returned {t_total:.3f} s after the calls although rank {late} "
                         f"entered {LATE_S:g} s late")
            check.note(f"calls returned in {max(took) * 1e3:.1f} ms at most")
        lo, hi = g.rank * c, (g.rank + 1) * c
        check.fail(_label("all_reduce", compare_reduction(ar, ar_in, "sum")))
        check.fail(_label("all_gather_into", compare_exact(ag_out, torch.cat(ag_in))))
        check.fail(_label("reduce_scatter", compare_reduction(rs_out, [t[lo:hi] for t in rs_in], "sum")))

    # ---- groups -----------------------------------------------------------------------
    def group(self, kind):
        """The group of *kind* (created on first use; creation is collective)."""
        if kind not in self._groups:
            n = self.n
            if kind == "subset":
                ranks = list(range(1, n)) if n >= 3 else [n - 1]
                self._groups[kind] = self.comm.new_group(ranks, name="conformance_subset")
            elif kind == "split":
                self._groups[kind] = self.comm.split(self.parity_partition(), "conformance_parity")
            elif kind == "intra_node":
                self._groups[kind] = self.comm.intra_node_group()
            elif kind == "inter_node":
                self._groups[kind] = self.comm.inter_node_group()
            elif kind == "world":
                self._groups[kind] = self.comm.world
            else:
                raise ValueError(kind)
        return self._groups[kind]

    def parity_partition(self):
        return [p for p in ([r for r in range(self.n) if r % 2 == 0],
                            [r for r in range(self.n) if r % 2 == 1]) if p]

    def expected_members(self, kind):
        n, r, rpn = self.n, self.rank, self.rpn
        return {
            "world": list(range(n)),
            "subset": list(range(1, n)) if n >= 3 else [n - 1],
            "split": [q for q in range(n) if q % 2 == r % 2],
            "intra_node": [q for q in range(n) if q // rpn == r // rpn],
            "inter_node": [q for q in range(n) if q % rpn == r % rpn],
        }[kind]

    def group_checks(self, check, kind):
        """Membership, spans_nodes, and every collective on the group (fp32 and bf16)."""
        g = self.group(kind)
        want = self.expected_members(kind)
        member = self.rank in want
        if kind == "subset" and not member:
            check.expect(not g.is_member and g.rank == -1,
                         f"rank {self.rank} is not in {want} but the group says rank={g.rank}")
            self.refused(check, "all_reduce on a group without this rank", ["member"],
                         lambda: self.comm.all_reduce(torch.zeros(2), group=g))
            return
        check.expect(list(g.ranks) == want, f"group ranks {list(g.ranks)}, expected {want}")
        if not check.expect(g.is_member and g.rank == want.index(self.rank),
                            f"this rank's group rank is {g.rank}, expected {want.index(self.rank)}"):
            return
        check.expect(g.size == len(want), f"group size {g.size}, expected {len(want)}")
        check.expect(g.spans_nodes == self.spans(want),
                     f"spans_nodes={g.spans_nodes}, expected {self.spans(want)} "
                     f"({self.rpn} ranks per node)")
        for dname in ("fp32", "bf16"):
            for run in (lambda: self.all_gather(check, dname, g),
                        lambda: self.reduce_scatter(check, dname, "sum", g),
                        lambda: self.all_reduce(check, dname, "max", g),
                        lambda: self.all_reduce(check, dname, "avg", g),
                        lambda: self.all_to_all(check, dname, g),
                        lambda: self.broadcast(check, dname, g)):
                try:
                    run()
                except Unsupported as exc:  # bf16 may be unsupported; fp32 may not
                    check.expect(dname != "fp32", f"fp32 unsupported: {exc}")
        if kind != "subset":  # (barrier() syncs the world; subset non-members left above)
            self.barrier(check, g)

    def topology(self, check):
        comm, n = self.comm, self.n
        topo = comm.topology
        check.expect(comm.rank == comm.launch.rank and comm.world_size == comm.launch.world_size,
                     f"communicator says rank {comm.rank}/{comm.world_size}, launcher "
                     f"{comm.launch.rank}/{comm.launch.world_size}")
        check.expect(topo.world_size == n and topo.ranks_per_node == self.rpn,
                     f"topology {topo}, expected {n} ranks with {self.rpn} per node")
        check.expect(list(comm.world.ranks) == list(range(n)) and comm.world.rank == self.rank,
                     f"world group {comm.world}")
        check.expect(comm.world.spans_nodes == (n // self.rpn > 1),
                     f"world spans_nodes={comm.world.spans_nodes} with {n // self.rpn} node(s)")
        import torch.distributed as dist
        check.expect(dist.is_initialized() and dist.get_rank() == self.rank
                     and dist.get_world_size() == n,
                     "torch.distributed is not initialized alongside the communicator with the "
                     "same rank and world size")
        check.note(f"{n // self.rpn} node(s) x {self.rpn}")

    def ledger(self, check, kind):
        """Every op once on the group (fp32, 5 elements per chunk); the ledger must match
        the table and the link class of the group."""
        g = self.group(kind)
        if not g.is_member:  # (only in the subset group) nothing to send, nothing recorded
            check.expect(list(g.ranks) == self.expected_members(kind), f"group {g}")
            check.note("not a member: nothing to record")
            return
        c, n = 5, g.size
        z = torch.zeros
        calls = [
            ("all_gather_into", z(c), False, lambda t: self.comm.all_gather_into(z(c * n), t, group=g)),
            ("reduce_scatter", z(c * n), False, lambda t: self.comm.reduce_scatter(z(c), t, group=g)),
            ("all_reduce", z(c), False, lambda t: self.comm.all_reduce(t, group=g)),
            ("all_to_all_single", z(c * n), False, lambda t: self.comm.all_to_all_single(z(c * n), t, group=g)),
            ("broadcast", z(c), g.rank == 0, lambda t: self.comm.broadcast(t, 0, group=g)),
            ("barrier", None, False, lambda t: self.comm.barrier(group=g)),
        ]
        for op, payload, is_source, call in calls:
            self.measured(check, op, g, payload, lambda: call(payload), is_source=is_source)
        check.note(f"{'inter' if g.spans_nodes else 'intra'}-node, {n} ranks")

    # ---- the whole list -----------------------------------------------------------------
    def run_all(self):
        rec = self.rec
        rec.run("topology", self.topology)
        for dname in DTYPES:
            rec.run(f"all_gather_into {dname}", self.all_gather, dname)
            for op in REDUCE_OPS:
                rec.run(f"reduce_scatter[{op}] {dname}", self.reduce_scatter, dname, op)
            for op in REDUCE_OPS:
                rec.run(f"all_reduce[{op}] {dname}", self.all_reduce, dname, op)
            rec.run(f"all_to_all_single {dname}", self.all_to_all, dname)
            rec.run(f"broadcast[every src] {dname}", self.broadcast, dname)
        rec.run("barrier", self.barrier)
        for case in ("uneven_sizes", "non_contiguous", "mixed_dtypes", "src_out_of_range",
                     "bad_reduce_op", "not_a_tensor", "non_member", "bad_groups"):
            rec.run(f"error/{case}", self.errors, case)
        rec.run("async/in_flight", self.async_in_flight)
        rec.run("async/returns_early", self.async_returns_early)
        for kind in ("subset", "split", "intra_node", "inter_node"):
            rec.run(f"group/{kind}", self.group_checks, kind)
        for kind in ("world", "subset", "split", "intra_node", "inter_node"):
            rec.run(f"ledger/{kind}", self.ledger, kind)


def _label(what, err):
    return f"{what}: {err}" if err else None
