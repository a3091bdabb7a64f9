"""The oneccl communicator (backends/comm/oneccl.py, oneccl_lib.py): Intel oneCCL's C API
through ctypes.

Without oneCCL installed, the error paths still run: every way the library, its CPU plugin,
the libccl.so.1 that plugin needs or the transport can be missing gives an unavailable
verdict saying what is missing and the command that fixes it, never an exception. The
multi-rank tests (the conformance suite on 2 ranks under mpirun and on 4 ranks as 2 emulated
nodes torchrun-style, each followed by oneCCL-specific checks against references; a late
peer and a collective stuck at exit) run when oneCCL is installed and skip otherwise, with
availability()'s own words as the reason.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import time

import pytest
import torch

from zero_core.backends.comm import oneccl_lib
from zero_core.backends.comm.oneccl import OneCclCommunicator
from zero_core.backends.comm.oneccl_lib import LIBRARY_INSTALL, elf_needed
from zero_core.errors import BackendUnavailable
from zero_core.runtime.launch import LaunchInfo
from zero_core.testing.ranks import mpirun_path, run_ranks
from zero_core.runtime.topology import resolve_ranks_per_node

WORKER = os.path.join(os.path.dirname(__file__), "workers", "oneccl_checks.py")
#: the variables availability() reads; cleared so that the machine's own do not interfere
LOOKUP_VARS = ("ZERO_CORE_ONECCL_LIBRARY", "CCL_ROOT", "LD_LIBRARY_PATH", "CCL_PLUGIN",
               "CCL_ATL_TRANSPORT", "CCL_MPI_LIBRARY_PATH", "CCL_OFI_LIBRARY_PATH",
               "I_MPI_OFI_LIBRARY", "I_MPI_ROOT")


@pytest.fixture
def lookup(monkeypatch, tmp_path):
    """A clean environment for availability() and a fake installation directory in which
    each test lays out the files it wants; fabric_candidates() is empty unless set."""
    for var in LOOKUP_VARS:
        monkeypatch.delenv(var, raising=False)
    libdir = tmp_path / "lib"
    libdir.mkdir()
    monkeypatch.setattr(oneccl_lib, "library_dirs", lambda: [str(libdir)])
    monkeypatch.setattr(oneccl_lib, "fabric_candidates", lambda: [])
    oneccl_lib._locate.cache_clear()
    yield libdir
    oneccl_lib._locate.cache_clear()


def _touch(*paths):
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")


def _complete(libdir):
    """libccl.so.2, the CPU plugin and a libccl.so.1 (empty files: nothing is loaded)."""
    _touch(libdir / "libccl.so.2", libdir / "libccl_legacy_cpu.so", libdir / "libccl.so.1")


def _verdict():
    ok, why = OneCclCommunicator.availability()
    assert isinstance(ok, bool) and isinstance(why, str)
    return ok, why


# ---- availability: what is missing and how to install it -----------------------------------
def test_missing_library_names_the_search_and_the_install_command(lookup):
    ok, why = _verdict()
    assert not ok
    assert "libccl.so.2 was not found" in why and str(lookup) in why
    assert LIBRARY_INSTALL in why
    assert "pip install --no-deps oneccl==2022.2.0" in why
    assert "pip install --no-deps --force-reinstall oneccl-cpu==2022.2.0" in why


def test_explicit_library_path_that_does_not_exist(lookup, monkeypatch, tmp_path):
    monkeypatch.setenv("ZERO_CORE_ONECCL_LIBRARY", str(tmp_path / "nowhere" / "libccl.so.2"))
    ok, why = _verdict()
    assert not ok and "ZERO_CORE_ONECCL_LIBRARY=" in why and "does not name a file" in why


def test_library_without_its_cpu_plugin(lookup):
    _touch(lookup / "libccl.so.2")           # e.g. only one of the two wheels
    ok, why = _verdict()
    assert not ok
    assert "libccl_legacy_cpu.so is missing" in why and LIBRARY_INSTALL in why


def test_plugin_without_libccl_so_1(lookup):
    _touch(lookup / "libccl.so.2", lookup / "libccl_legacy_cpu.so")
    ok, why = _verdict()
    assert not ok
    assert "libccl.so.1" in why and "oneccl-cpu==2022.2.0" in why and "--force-reinstall" in why


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build a fake ELF")
def test_sycl_build_of_libccl_so_1_without_the_gpu_runtime(lookup, tmp_path):
    """The `oneccl` wheel's libccl.so.1 needs libsycl.so.9; without intel-sycl-rt the verdict
    says so and names the CPU build that replaces it (read from the ELF, nothing loaded)."""
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir()
    src = tmp_path / "empty.c"
    src.write_text("int zero_core_fake(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(stub_dir / "libsycl.so.9"),
                    "-Wl,-soname,libsycl.so.9", str(src)], check=True, capture_output=True)
    _touch(lookup / "libccl.so.2", lookup / "libccl_legacy_cpu.so")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lookup / "libccl.so.1"), str(src),
                    "-Wl,--no-as-needed", str(stub_dir / "libsycl.so.9")],
                   check=True, capture_output=True)
    assert "libsycl.so.9" in elf_needed(str(lookup / "libccl.so.1"))
    shutil.rmtree(stub_dir)                  # the GPU runtime is not installed
    ok, why = _verdict()
    assert not ok
    assert "SYCL (GPU) build" in why and "libsycl.so.9" in why and "intel-sycl-rt" in why
    assert "pip install --no-deps --force-reinstall oneccl-cpu==2022.2.0" in why


def test_elf_needed_reads_real_libraries_and_rejects_other_files(tmp_path):
    assert "libc.so.6" in elf_needed(shutil.which("ls") or "/bin/ls")
    (tmp_path / "text.so").write_text("not an ELF file")
    assert elf_needed(str(tmp_path / "text.so")) == []
    assert elf_needed(str(tmp_path / "missing.so")) == []


def test_no_transport_says_which_library_and_package(lookup):
    _complete(lookup)
    ok, why = _verdict()
    assert not ok
    assert "no transport library" in why and "libfabric.so.1" in why
    assert "pip install 'zero-core[oneccl]'" in why and "apt-get install libfabric1" in why
    assert "CCL_OFI_LIBRARY_PATH" in why


def test_transport_path_that_does_not_exist(lookup, monkeypatch, tmp_path):
    _complete(lookup)
    monkeypatch.setenv("CCL_OFI_LIBRARY_PATH", str(tmp_path / "no" / "libfabric.so.1"))
    ok, why = _verdict()
    assert not ok and "CCL_OFI_LIBRARY_PATH=" in why and "does not name a file" in why


def test_mpi_transport_needs_an_mpich_abi_library(lookup, monkeypatch, tmp_path):
    _complete(lookup)
    monkeypatch.setenv("CCL_ATL_TRANSPORT", "mpi")
    monkeypatch.setenv("CCL_MPI_LIBRARY_PATH", str(tmp_path / "libmpi.so.12"))
    ok, why = _verdict()
    assert not ok and "MPICH-ABI libmpi.so.12" in why and "unset CCL_ATL_TRANSPORT" in why


def test_a_complete_installation_is_available(lookup, monkeypatch, tmp_path):
    _complete(lookup)
    fabric = tmp_path / "openmpi" / "libfabric.so.1"
    _touch(fabric)
    monkeypatch.setattr(oneccl_lib, "fabric_candidates", lambda: [str(fabric)])
    found = oneccl_lib.locate()
    assert _verdict() == (True, "")
    assert found["lib"] == str(lookup / "libccl.so.2")
    assert found["plugin"] == str(lookup / "libccl_legacy_cpu.so")
    assert found["fabric"] == str(fabric)


def test_availability_never_raises_and_is_cheap(lookup, monkeypatch):
    def broken():
        raise PermissionError("search path unreadable")
    monkeypatch.setattr(oneccl_lib, "library_dirs", broken)
    ok, why = _verdict()
    assert not ok and "PermissionError" in why and "unreadable" in why
    monkeypatch.undo()
    oneccl_lib._locate.cache_clear()
    start = time.perf_counter()
    OneCclCommunicator.availability()        # the real search, uncached
    assert time.perf_counter() - start < 0.5


def test_constructor_refuses_with_the_same_words(lookup):
    launch = LaunchInfo(0, 1, 0, 1, "single")
    with pytest.raises(BackendUnavailable, match="communicator 'oneccl' cannot run here: "
                                                 "oneCCL's C API library libccl.so.2"):
        OneCclCommunicator(launch, resolve_ranks_per_node(1, 1))


def test_registered_as_a_builtin_with_its_dtypes():
    from zero_core.runtime import registry
    reg = registry.load(refresh=True)
    assert reg.communicators["oneccl"].obj is OneCclCommunicator
    assert reg.communicators["oneccl"].plugin == "builtin"
    comm = OneCclCommunicator.__new__(OneCclCommunicator)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                  torch.uint8, torch.int32, torch.int64):
        assert comm.supports("all_reduce", dtype)
    assert not comm.supports("all_reduce", torch.bool)
    assert not comm.supports("all_gather_into", torch.complex64)


def test_settings_fill_in_defaults_and_keep_the_users_own(monkeypatch):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CCL_", "FI_"))}
    env["FI_PROVIDER"] = "tcp;ofi_rxm"           # a user's choice
    monkeypatch.setattr(os, "environ", env)
    comm = OneCclCommunicator.__new__(OneCclCommunicator)
    comm.launch = LaunchInfo(1, 4, 1, 2, "torchrun")   # 2 hosts x 2 ranks
    comm.world_size, comm.settings = 4, {}
    comm._found = {"plugin": "/x/libccl_legacy_cpu.so", "fabric": "/y/libfabric.so.1"}
    comm._apply_settings()
    assert env["FI_PROVIDER"] == "tcp;ofi_rxm" and "FI_PROVIDER" not in comm.settings
    assert comm.settings["CCL_PLUGIN"] == "/x/libccl_legacy_cpu.so"
    assert comm.settings["CCL_OFI_LIBRARY_PATH"] == "/y/libfabric.so.1"
    assert (comm.settings["CCL_LOCAL_RANK"], comm.settings["CCL_LOCAL_SIZE"]) == ("1", "2")
    assert comm.settings["CCL_WORKER_OFFLOAD"] == "0" and comm.settings["CCL_ATL_SHM"] == "1"
    assert "CCL_KVS_IFACE" not in comm.settings      # several hosts: not the loopback
    comm.launch, comm.world_size, comm.settings = LaunchInfo(0, 2, 0, 2, "openmpi"), 2, {}
    comm._apply_settings()
    # everything else was set by the first call and is left alone; one host: the loopback
    assert comm.settings == {"CCL_KVS_IFACE": "lo", "FI_TCP_IFACE": "lo"}


# ---- real ranks ------------------------------------------------------------------------------
def _require_oneccl():
    ok, why = OneCclCommunicator.availability()
    if not ok:
        pytest.skip(f"oneCCL cannot run here: {why}")


def test_world_of_one_runs_locally(monkeypatch):
    """One rank: no oneCCL communicator and no rendezvous; every collective is the identity
    and shutdown is clean."""
    _require_oneccl()
    monkeypatch.setattr(os, "environ", dict(os.environ))   # settings stay in this test
    comm = OneCclCommunicator(LaunchInfo(0, 1, 0, 1, "single"), resolve_ranks_per_node(1, 1))
    try:
        t = torch.arange(6.0)
        comm.all_reduce(t, op="avg")
        out = torch.empty(6)
        comm.all_gather_into(out, t)
        comm.reduce_scatter(out, t, op="max")
        comm.all_to_all_single(out, t)
        comm.broadcast(t, src=0)
        comm.barrier()
        assert torch.equal(t, torch.arange(6.0)) and torch.equal(out, t)
        assert comm.library_version == 20220200
    finally:
        comm.shutdown()
        comm.shutdown()


def _assert_job(results, world, rpn):
    log = results[0].log[-6000:]
    reports = [r.report for r in results]
    assert all(rep is not None for rep in reports), f"a rank reported nothing:\n{log}"
    for rep in reports:
        suite = rep["suite"]
        failing = {n: r["detail"] for n, r in suite["results"].items() if r["status"] == "FAIL"}
        assert suite["ok"] and not failing and not suite["aborted"], failing
        assert (suite["comm"], suite["world_size"], suite["ranks_per_node"]) == \
            ("oneccl", world, rpn)
        # the full list ran, fp32 all passed; only integer averages may be declined
        statuses = {n: r["status"] for n, r in suite["results"].items()}
        assert len(statuses) == 5 * 11 + 1 + 8 + 2 + 4 + 5 + 1
        unsupported = sorted(n for n, s in statuses.items() if s == "unsupported")
        assert unsupported == sorted(f"{op}[avg] {d}" for op in ("all_reduce", "reduce_scatter")
                                     for d in ("int8", "uint8")), unsupported
        assert rep["failures"] == [] and rep["checks"] >= 30, rep["failures"]
        assert rep["library_version"] == 20220200
    return reports


@pytest.mark.multirank
def test_two_ranks_conformance_references_late_peer_and_stuck_exit():
    """2 ranks (mpirun when it is installed): the conformance suite, the references, then a
    peer joining 4 s late (CommTimeoutError at the 2 s deadline, a second wait succeeds)
    and a collective nobody joins when rank 0 exits (the exit hook ends it: status 1)."""
    _require_oneccl()
    launcher = "mpirun" if mpirun_path() else "torchrun"
    seed = random.randrange(1 << 20)
    start = time.monotonic()
    results = run_ranks(WORKER, 2, launcher=launcher, args=[seed, "faults"], timeout=240,
                        check=False)
    reports = _assert_job(results, 2, 2)
    late = reports[0]["late"]
    assert late["first"]["is_timeout"], late
    assert "all_reduce on group 'world' (ranks [0, 1]) did not finish within 2 s" in \
        late["first"]["error"]
    assert 1.9 < late["waited"] < 3.5 and late["ok"] and reports[1]["late"]["ok"]
    # the job ended on its own, well before run_ranks' timeout, with rank 0's exit status
    assert time.monotonic() - start < 200
    assert results[0].returncode == 1
    assert "has not completed; ending the process with os._exit(1)" in results[0].log
    # oneCCL got the settings, and everything stayed on this host
    settings = reports[0]["settings"]
    for key in ("CCL_PLUGIN", "CCL_OFI_LIBRARY_PATH", "CCL_KVS_IFACE", "FI_TCP_IFACE"):
        assert key in settings or key in os.environ, key


@pytest.mark.multirank
def test_four_ranks_as_two_nodes_conformance_and_references():
    _require_oneccl()
    seed = random.randrange(1 << 20)
    results = run_ranks(WORKER, 4, launcher="torchrun", args=[seed], timeout=300, check=False,
                        env={"ZERO_CORE_RANKS_PER_NODE": "2"})
    assert [r.returncode for r in results] == [0] * 4, results[0].log[-4000:]
    reports = _assert_job(results, 4, 2)
    notes = {n: r["detail"] for n, r in reports[0]["suite"]["results"].items()}
    assert "inter-node" in notes["ledger/world"] and "intra-node" in notes["ledger/intra_node"]
