"""The communication ledger (zero_core.interfaces.ledger): the sent-bytes table, totals, differences,
and the recording done by the Communicator base class (with an in-process fake backend)."""
import threading
from fractions import Fraction

import pytest
import torch

from zero_core.interfaces.communicator import Communicator, Group, Handle
from zero_core.errors import CommError
from zero_core.runtime.launch import LaunchInfo
from zero_core.interfaces.ledger import CommLedger, LedgerEntry, sent_bytes
from zero_core.runtime.topology import Topology

OPS = ("all_gather_into", "reduce_scatter", "all_reduce", "all_to_all_single", "broadcast", "barrier")


def expected_sent(op, n, nbytes, is_source):
    """The table of the ledger's docstring, in exact rational arithmetic, rounded down."""
    if n == 1:
        return 0
    per_rank = {
        "all_gather_into": Fraction(n - 1) * nbytes,
        "reduce_scatter": Fraction(n - 1, n) * nbytes,
        "all_reduce": 2 * Fraction(n - 1, n) * nbytes,
        "all_to_all_single": Fraction(n - 1, n) * nbytes,
        "broadcast": Fraction(nbytes if is_source else 0),
        "barrier": Fraction(0),
    }[op]
    return int(per_rank)  # floor: bytes are whole


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
def test_sent_bytes_table(op, n):
    for nbytes in (0, 1, 4, 96, 1000, 4096 * 3 + 2):
        for is_source in (False, True):
            assert sent_bytes(op, n, nbytes, is_source) == expected_sent(op, n, nbytes, is_source), \
                (op, n, nbytes, is_source)


def test_sent_bytes_examples():
    # ring all-reduce of 1 MiB on 4 ranks sends 1.5 MiB per rank
    assert sent_bytes("all_reduce", 4, 1 << 20) == 3 << 19
    # all-gather of a 100-byte shard to 8 ranks: 700 bytes out
    assert sent_bytes("all_gather_into", 8, 100) == 700
    assert sent_bytes("broadcast", 8, 100, is_source=True) == 100
    assert sent_bytes("broadcast", 8, 100, is_source=False) == 0


def test_unknown_op():
    with pytest.raises(ValueError, match="gather_scatter"):
        sent_bytes("gather_scatter", 4, 10)


def entry(op, sent, inter, payload=None, group="g"):
    return LedgerEntry(op=op, group=group, dtype="float32",
                       payload_bytes=sent if payload is None else payload,
                       sent_bytes=sent, inter_node=inter)


def test_snapshot_totals_and_split_by_link():
    ledger = CommLedger()
    ledger.record(entry("all_reduce", 100, True, payload=64))
    ledger.record(entry("all_reduce", 30, False, payload=20))
    ledger.record(entry("broadcast", 7, False))
    ledger.record(entry("barrier", 0, True, payload=0))
    snap = ledger.snapshot()
    assert snap["ops"]["all_reduce"] == dict(calls=2, payload_bytes=84, sent_bytes=130,
                                             inter_node_bytes=100, intra_node_bytes=30,
                                             staged_bytes=0, staging_s=0.0)
    assert snap["ops"]["broadcast"] == dict(calls=1, payload_bytes=7, sent_bytes=7,
                                            inter_node_bytes=0, intra_node_bytes=7,
                                            staged_bytes=0, staging_s=0.0)
    assert snap["ops"]["barrier"]["calls"] == 1
    assert (snap["sent_bytes"], snap["inter_node_bytes"], snap["intra_node_bytes"]) == (137, 100, 37)


def test_difference_between_snapshots():
    ledger = CommLedger()
    ledger.record(entry("all_reduce", 100, True))
    ledger.record(entry("broadcast", 5, False))
    before = ledger.snapshot()
    ledger.record(entry("all_reduce", 40, False, payload=33))
    ledger.record(entry("all_gather_into", 12, True))
    after = ledger.snapshot()
    diff = CommLedger.difference(after, before)
    assert set(diff["ops"]) == {"all_reduce", "all_gather_into"}  # broadcast did not happen
    assert diff["ops"]["all_reduce"] == dict(calls=1, payload_bytes=33, sent_bytes=40,
                                             inter_node_bytes=0, intra_node_bytes=40,
                                             staged_bytes=0, staging_s=0.0)
    assert diff["ops"]["all_gather_into"]["inter_node_bytes"] == 12
    assert (diff["sent_bytes"], diff["inter_node_bytes"], diff["intra_node_bytes"]) == (52, 12, 40)
    # snapshots are copies: recording later does not change them
    ledger.record(entry("all_reduce", 1000, True))
    assert CommLedger.difference(after, before) == diff
    empty = CommLedger.difference(after, after)
    assert empty["ops"] == {} and empty["sent_bytes"] == 0


def test_keep_entries_and_reset():
    ledger = CommLedger(keep_entries=2)
    for i in range(5):
        ledger.record(entry("all_reduce", i, False))
    assert [e.sent_bytes for e in ledger.entries] == [0, 1]
    assert ledger.snapshot()["sent_bytes"] == 10  # totals keep counting past the kept entries
    assert CommLedger().entries == []  # keeping entries is opt-in
    ledger.reset()
    assert ledger.entries == [] and ledger.snapshot() == {
        "ops": {}, "transfers": {}, "sent_bytes": 0, "inter_node_bytes": 0,
        "intra_node_bytes": 0, "staged_bytes": 0, "staging_s": 0}


def test_record_is_thread_safe():
    ledger = CommLedger()
    threads = [threading.Thread(target=lambda k=k: [ledger.record(entry("all_reduce", k, k % 2 == 0))
                                                    for _ in range(2000)]) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = ledger.snapshot()
    assert snap["ops"]["all_reduce"]["calls"] == 8000
    assert snap["sent_bytes"] == 2000 * (1 + 2 + 3 + 4)
    assert snap["inter_node_bytes"] == 2000 * (2 + 4)


# ---- recording by the Communicator base class ---------------------------------------------
class EchoCommunicator(Communicator):
    """A world of *world_size* simulated ranks in one process, of which we are rank 0.

    It moves no data (the values are not what is tested here), only records which backend
    hook ran, so that the base class's validation and ledger recording can be checked
    without peers.
    """

    name = "echo"

    @classmethod
    def availability(cls):
        return True, ""

    def __init__(self, *a, wire=None, **kw):
        self.calls = []
        self._wire = wire
        super().__init__(*a, **kw)

    def _init_world(self):
        ranks = tuple(range(self.world_size))
        return Group("world", ranks, self.rank, self.topology.spans_nodes(ranks))

    def _new_group(self, ranks, name):
        return None

    def _handle(self, op, group):
        self.calls.append(op)
        h = Handle(op, group, self.timeout, wait_fn=lambda t: True)
        if self._wire:
            h.wire_op, h.wire_payload_bytes = self._wire
        return h

    def _all_gather_into(self, output, input, group):
        return self._handle("all_gather_into", group)

    def _reduce_scatter(self, output, input, op, group):
        return self._handle("reduce_scatter", group)

    def _all_reduce(self, tensor, op, group):
        return self._handle("all_reduce", group)

    def _all_to_all_single(self, output, input, group):
        return self._handle("all_to_all_single", group)

    def _broadcast(self, tensor, src, group):
        return self._handle("broadcast", group)

    def _barrier(self, group):
        return self._handle("barrier", group)


def echo(world=4, rpn=2, **kw):
    return EchoCommunicator(LaunchInfo(0, world, 0, rpn, "torchrun"), Topology(world, rpn), **kw)


def test_base_class_records_each_collective_by_the_table():
    comm = echo()
    t = torch.zeros(12, dtype=torch.bfloat16)  # 24 bytes
    intra = comm.new_group([0, 1])
    inter = comm.new_group([0, 2])
    assert not intra.spans_nodes and inter.spans_nodes and comm.world.spans_nodes
    cases = [
        (lambda: comm.all_gather_into(torch.zeros(48, dtype=torch.bfloat16), t), "all_gather_into", comm.world, 24),
        (lambda: comm.reduce_scatter(torch.zeros(6, dtype=torch.bfloat16), t, group=intra), "reduce_scatter", intra, 24),
        (lambda: comm.all_reduce(t, "max", group=inter), "all_reduce", inter, 24),
        (lambda: comm.all_to_all_single(torch.zeros_like(t), t), "all_to_all_single", comm.world, 24),
        (lambda: comm.barrier(group=inter), "barrier", inter, 0),
    ]
    for call, op, group, payload in cases:
        before = comm.ledger.snapshot()
        call()
        diff = CommLedger.difference(comm.ledger.snapshot(), before)
        want = expected_sent(op, group.size, payload, False)
        assert diff["ops"] == {op: dict(calls=1, payload_bytes=payload, sent_bytes=want,
                                        inter_node_bytes=want if group.spans_nodes else 0,
                                        intra_node_bytes=0 if group.spans_nodes else want,
                                        staged_bytes=0, staging_s=0.0)}, op
    # broadcast: the source sends, the others do not
    before = comm.ledger.snapshot()
    comm.broadcast(t, src=0, group=inter)  # we are group rank 0: the source
    comm.broadcast(t, src=1, group=inter)
    diff = CommLedger.difference(comm.ledger.snapshot(), before)
    assert diff["ops"]["broadcast"]["calls"] == 2 and diff["inter_node_bytes"] == 24


def test_backend_substitution_is_counted_as_what_went_over_the_wire():
    comm = echo(wire=("all_reduce", 96))  # e.g. an all-gather carried as an all-reduce
    comm.all_gather_into(torch.zeros(24), torch.zeros(6))
    snap = comm.ledger.snapshot()
    assert list(snap["ops"]) == ["all_reduce"]
    assert snap["ops"]["all_reduce"]["payload_bytes"] == 96
    assert snap["sent_bytes"] == expected_sent("all_reduce", 4, 96, False)


@pytest.mark.parametrize("call, words", [
    (lambda c: c.all_gather_into(torch.zeros(7), torch.zeros(2)), ["all_gather_into", "8"]),
    (lambda c: c.reduce_scatter(torch.zeros(2), torch.zeros(9)), ["reduce_scatter", "9"]),
    (lambda c: c.all_to_all_single(torch.zeros(6), torch.zeros(6)), ["all_to_all_single", "divisible"]),
    (lambda c: c.all_to_all_single(torch.zeros(4), torch.zeros(8)), ["all_to_all_single"]),
    (lambda c: c.all_reduce(torch.zeros(4, 4).t()), ["all_reduce", "contiguous"]),
    (lambda c: c.all_gather_into(torch.zeros(8, dtype=torch.float16), torch.zeros(2)), ["dtype"]),
    (lambda c: c.all_reduce(torch.zeros(4), "prod"), ["'prod'"]),
    (lambda c: c.broadcast(torch.zeros(4), src=4), ["src=4"]),
    (lambda c: c.broadcast(torch.zeros(4), src=-1), ["src=-1"]),
    (lambda c: c.all_reduce([1.0, 2.0]), ["torch.Tensor"]),
    (lambda c: c.all_reduce(torch.zeros(2), group=c.new_group([1, 2])), ["not a member"]),
    (lambda c: c.new_group([0, 4]), ["[0, 4]"]),
    (lambda c: c.new_group([1, 1]), ["distinct"]),
    (lambda c: c.split([[0, 1], [2]], "bad"), ["every rank"]),
])
def test_refused_calls_reach_neither_backend_nor_ledger(call, words):
    comm = echo()
    before = comm.ledger.snapshot()
    with pytest.raises(CommError) as err:
        call(comm)
    for word in words:
        assert word in str(err.value)
    assert comm.calls == []
    assert comm.ledger.snapshot() == before


def test_unsupported_dtype_is_refused_before_the_backend():
    class NoInt8(EchoCommunicator):
        def supports(self, op, dtype):
            return dtype != torch.int8

    comm = NoInt8(LaunchInfo(0, 2, 0, 2, "torchrun"), Topology(2, 2))
    with pytest.raises(CommError, match="int8"):
        comm.all_reduce(torch.zeros(4, dtype=torch.int8))
    assert comm.calls == [] and comm.ledger.snapshot()["ops"] == {}
    comm.all_reduce(torch.zeros(4, dtype=torch.uint8))
    assert comm.calls == ["all_reduce"]


def test_async_handle_and_timeout_message():
    comm = echo()
    assert comm.all_reduce(torch.zeros(4), async_op=False) is None
    h = comm.all_reduce(torch.zeros(4), async_op=True)
    h.wait()
    assert h.is_completed()
    stuck = Handle("all_reduce", comm.world, 0.25, wait_fn=lambda t: False)
    with pytest.raises(CommError, match="did not finish within 0.25 s") as err:
        stuck.wait()
    assert "ranks [0, 1, 2, 3]" in str(err.value)

    def dead(_timeout):
        raise OSError("connection reset by peer")
    with pytest.raises(CommError, match="connection reset by peer"):
        Handle("broadcast", comm.world, 1.0, wait_fn=dead).wait()


def test_split_and_topology_groups():
    comm = echo(world=4, rpn=2)
    g = comm.split([[0, 3], [1, 2]], "pairs")
    assert g.ranks == (0, 3) and g.rank == 0 and g.spans_nodes and g.name.startswith("pairs")
    intra, inter = comm.intra_node_group(), comm.inter_node_group()
    assert intra.ranks == (0, 1) and not intra.spans_nodes
    assert inter.ranks == (0, 2) and inter.spans_nodes
    assert comm.intra_node_group() is intra  # cached


def test_staging_copies_are_counted_per_collective_and_in_differences():
    ledger = CommLedger()
    ledger.record(entry("all_gather_into", 40, False, payload=40))
    before = ledger.snapshot()
    ledger.record(entry("all_gather_into", 40, False, payload=40))
    ledger.record_staging("all_gather_into", 120, 0.25)
    snap = ledger.snapshot()
    assert snap["ops"]["all_gather_into"]["staged_bytes"] == 120
    assert (snap["staged_bytes"], snap["staging_s"]) == (120, 0.25)
    diff = CommLedger.difference(snap, before)
    assert (diff["staged_bytes"], diff["staging_s"]) == (120, 0.25)
    ledger.reset()
    assert ledger.snapshot()["staged_bytes"] == 0


def test_host_device_copies_are_counted_on_the_destination_side_when_they_cross():
    import torch
    ledger = CommLedger()

    class Fake:  # a tensor on another device, as far as the ledger can tell
        def __init__(self, device, numel, size):
            self.device, self._numel, self._size = torch.device(device), numel, size

        def numel(self):
            return self._numel

        def element_size(self):
            return self._size

    host = torch.zeros(10)
    ledger.record_copy("offload_optimizer", host, Fake("cuda", 10, 2))   # bf16 in, fp32 out
    ledger.record_copy("offload_optimizer", Fake("cuda", 10, 2), host)
    ledger.record_copy("offload_optimizer", host, torch.zeros(10))      # same side: free
    before = ledger.snapshot()
    assert before["transfers"] == {"offload_optimizer": {"d2h": 40, "h2d": 20}}
    ledger.record_copy("offload_param", Fake("cuda", 5, 2), host)
    diff = CommLedger.difference(ledger.snapshot(), before)
    assert diff["transfers"] == {"offload_param": {"h2d": 10, "d2h": 0}}
