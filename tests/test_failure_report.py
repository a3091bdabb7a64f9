"""One error, once (issue 16 items 5 and 6): what a failing multi-rank job prints, and the
one-line notice of a job started without a launcher.

The multi-rank tests launch real jobs whose ranks die of an uncaught exception
(tests/workers/failure_report.py) and read the job's output: under mpirun one combined
log, under torchrun-style launches one log per rank (``RankResult.log``). The pieces of
``zero_core.runtime.failures`` (job ids, markers, what counts as a peer's failure, the
user's code location, the hook's fallback) are tested in-process.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import zero_core
from zero_core.errors import CommError, CommTimeoutError, ConfigError
from zero_core.interfaces.communicator import Group, Handle
from zero_core.runtime import failures, launch as launch_mod
from zero_core.runtime.failures import (FailureReport, failure_key, job_id,
                                        peer_failure_reason, user_location)
from zero_core.runtime.launch import LaunchInfo, single_process_notice
from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "failure_report.py")
STAGE7 = "ConfigError: config key 'zero_optimization.stage' = 7: expected 0, 1, 2 or 3"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
               "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID")


def _job(launcher, mode, tmp_path, nprocs=2, env=None):
    """Run *mode* on *nprocs* ranks; return the results and the job's whole output."""
    sync = tmp_path / f"{launcher}-{mode}-{sorted((env or {}).items())}"
    sync.mkdir()
    res = run_ranks(WORKER, nprocs, launcher=launcher, args=[mode, str(sync)], env=env,
                    timeout=120, check=False)
    log = res[0].log if launcher == "mpirun" else "".join(r.log for r in res)
    assert [r.returncode for r in res] == [1] * nprocs, log[-4000:]  # Python's status, kept
    return res, log


def _printer_and_pointers(log: str, headline: str, ranks) -> int:
    """The rank of *ranks* that printed *headline* (exactly once in the job); each other
    rank of *ranks* must have printed the one-line pointer to it."""
    printed = re.findall(rf"zero-core: rank (\d) failed: {re.escape(headline)}", log)
    assert len(printed) == 1, log[-4000:]
    k = int(printed[0])
    assert k in ranks
    for other in set(ranks) - {k}:
        assert f"zero-core: rank {other}: same error as rank {k} (printed by that rank; " \
               f"ZERO_CORE_DEBUG=1 prints every rank's traceback)" in log, log[-4000:]
    return k


@pytest.mark.multirank
def test_a_config_error_on_every_rank_is_printed_once(tmp_path):
    """Under mpirun and torchrun, side by side (each job is mostly Python starting up).
    ZERO_CORE_DEBUG=1 installs no hook (checked in process below), which leaves Python's
    report: every rank's traceback."""
    jobs = {"mpirun": ("mpirun", None), "torchrun": ("torchrun", None)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(_job, launcher, "config", tmp_path, env=env)
                   for name, (launcher, env) in jobs.items()}
        done = {name: future.result() for name, future in futures.items()}
    for name in ("mpirun", "torchrun"):
        res, log = done[name]
        assert log.count("'zero_optimization.stage' = 7") == 1, log[-4000:]
        k = _printer_and_pointers(log, STAGE7, [0, 1])
        assert "Traceback" not in log, log[-4000:]  # a ZeroCoreError: the user's line instead
        assert re.search(r"\n(\[rank\d\]: )?  raised from \S*tests/workers/failure_report\.py:"
                         r"\d+ in <module>\n", log), log[-4000:]
        if name == "torchrun":  # each rank's own output holds its own line, and only that
            assert res[k].log.count("zero-core") == 1 and res[1 - k].log.count("zero-core") == 1
            assert "failed: ConfigError" in res[k].log and "same error" in res[1 - k].log


@pytest.mark.multirank
def test_the_users_own_error_prints_one_traceback_and_a_peer_one_line(tmp_path):
    """Ranks 1 and 2 raise the script's KeyError; rank 0, waiting for them in an
    all_reduce, sees gloo's dead connections: a consequence, told in one line."""
    res, log = _job("torchrun", "keyerror", tmp_path, nprocs=3,
                    env={"ZERO_CORE_COMM_TIMEOUT": "30"})
    _printer_and_pointers(log, "KeyError: 'no_such_column'", [1, 2])
    assert log.count("Traceback (most recent call last)") == 1, log[-4000:]
    assert log.count("KeyError: 'no_such_column'") == 2  # our headline + the traceback's
    assert "return table[column]" in log  # the traceback reaches the user's line
    lines = [line for line in res[0].log.splitlines() if line.strip()]
    assert len(lines) == 1, res[0].log[-3000:]
    assert re.search(r"zero-core: rank 0 stopped: a peer rank failed \(CommError: all_reduce "
                     r"on group 'world' .*Connection (closed|reset) by peer", lines[0]), lines


# ---- in-process: the pieces ---------------------------------------------------------------
LAUNCHED = LaunchInfo(0, 2, 0, 2, "torchrun")


@pytest.fixture
def markers(monkeypatch, tmp_path):
    """Marker directories under *tmp_path* instead of the machine's temporary directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _report(rank: int, job: str | None = "job-a", previous=None) -> FailureReport:
    return FailureReport(LaunchInfo(rank, 4, rank, 4, "openmpi"), job,
                         previous or (lambda *a: None))


def test_the_first_rank_claims_an_error_and_the_others_point_at_it(markers):
    key = failure_key(ConfigError("bad stage"))
    assert key == failure_key(ConfigError("bad stage"))
    assert key != failure_key(ConfigError("bad stage 2")) != failure_key(ValueError("bad stage"))
    assert _report(2).claim(key) is None           # first: prints it
    assert _report(0).claim(key) == 2               # later ranks: rank 2 printed it
    assert _report(3).claim(key) == 2
    assert _report(0, job="job-b").claim(key) is None  # another job prints its own
    assert _report(0).claim(failure_key(ConfigError("other"))) is None
    job_dir = markers / os.path.basename(failures.marker_root()) / "job-a"
    assert sorted(os.listdir(job_dir)) == sorted([key, failure_key(ConfigError("other"))])


def test_an_earlier_jobs_marker_is_taken_over(markers):
    key = failure_key(KeyError("x"))
    assert _report(1).claim(key) is None
    marker = markers / os.path.basename(failures.marker_root()) / "job-a" / key
    marker.write_text(f"1 {time.time() - failures.FRESH_S - 5:.3f}\n")  # a rerun, later
    assert _report(0).claim(key) is None  # printed again: nothing in this job printed it
    assert _report(1).claim(key) == 0
    marker.write_text("garbled")
    assert _report(3).claim(key) is None


def test_no_marker_directory_means_printing_in_full(markers):
    assert _report(1, job=None).claim("k") is None and _report(2, job=None).claim("k") is None
    root = markers / os.path.basename(failures.marker_root())
    root.mkdir()
    (root / "job-a").write_text("a file where the job's directory goes")
    assert _report(1).claim("k") is None and _report(2).claim("k") is None


def test_old_job_directories_are_pruned(markers):
    root = markers / os.path.basename(failures.marker_root())
    (root / "old").mkdir(parents=True)
    (root / "recent").mkdir()
    day_ago = time.time() - 2 * 86400
    os.utime(root / "old", (day_ago, day_ago))
    assert _report(0).claim("k") is None
    assert sorted(os.listdir(root)) == ["job-a", "recent"]


@pytest.mark.parametrize("info, env, expected", [
    (LaunchInfo(1, 2, 1, 2, "openmpi"), {"PMIX_NAMESPACE": "prterun-vm-6693@1"},
     "mpi-prterun-vm-6693_1"),                                # Open MPI 5 (measured)
    (LaunchInfo(1, 2, 1, 2, "openmpi"), {"OMPI_MCA_ess_base_jobid": "123456",
                                         "PMIX_NAMESPACE": "x"}, "mpi-123456"),  # Open MPI 4
    (LaunchInfo(1, 2, 1, 2, "pmix"), {"PMIX_NAMESPACE": "slurm.pmix.77.0"},
     "mpi-slurm.pmix.77.0"),
    (LaunchInfo(1, 2, 1, 2, "torchrun"), {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
     "torch-10.0.0.1-29500"),
    (LaunchInfo(1, 2, 1, 2, "slurm"), {"SLURM_JOB_ID": "991", "SLURM_STEP_ID": "3"},
     "slurm-991-3"),
])
def test_job_ids_come_from_the_launcher(info, env, expected):
    assert job_id(info, env) == expected


def test_torchruns_job_id_holds_the_agent_so_a_rerun_differs():
    env = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert job_id(LAUNCHED, env) == f"torchrun-none-{os.getppid()}-2"


def test_without_a_launcher_id_the_parent_process_names_the_job():
    name = job_id(LaunchInfo(0, 2, 0, 2, "mpich"), {})
    if os.path.exists(f"/proc/{os.getppid()}/stat"):
        assert re.fullmatch(rf"mpich-parent-{os.getppid()}-\d+", name)
    else:
        assert name is None


def _handle_that_fails(exc: BaseException) -> Handle:
    def wait(_timeout):
        raise exc
    return Handle("all_reduce", Group("world", (0, 1), 0, False, None), 5.0, wait)


def test_what_counts_as_a_peers_failure():
    with pytest.raises(CommError) as gone:  # what the communicator makes of gloo's words
        _handle_that_fails(RuntimeError("[pair.cc:553] Connection closed by peer "
                                        "[127.0.0.1]:19855")).wait()
    assert peer_failure_reason(gone.value).startswith(
        "CommError: all_reduce on group 'world' (ranks [0, 1]) failed: [pair.cc:553]")
    timed_out = Handle("all_reduce", Group("world", (0, 1), 0, False, None), 0.01,
                       lambda t: False)
    with pytest.raises(CommTimeoutError) as late:
        timed_out.wait()
    assert "did not finish within" in peer_failure_reason(late.value)
    assert peer_failure_reason(ConnectionResetError("Connection reset by peer"))
    assert len(peer_failure_reason(CommTimeoutError("x" * 5000))) < 600  # one short line
    # causes, not consequences
    assert peer_failure_reason(CommError("all_reduce: the gloo communicator cannot carry "
                                         "dtype torch.bool")) is None
    assert peer_failure_reason(ConfigError("stage 7")) is None
    assert peer_failure_reason(KeyError("Connection")) is None


def _raise_config_error():
    zero_core.initialize(model=None)  # zero-core raises it, several frames down


def test_a_zero_core_error_shows_the_users_line_and_no_traceback(markers):
    try:
        _raise_config_error()
    except ConfigError as exc:
        tb = exc.__traceback__
        where = user_location(tb)
        text = _report(3).render(type(exc), exc, tb)
    assert re.fullmatch(r"\S*test_failure_report\.py:\d+ in _raise_config_error", where)
    assert text == (f"zero-core: rank 3 failed: ConfigError: initialize() needs "
                    f"model=<torch.nn.Module>\n  raised from {where}\n")
    assert _report(0).render(ConfigError, ConfigError("initialize() needs model="
                                                      "<torch.nn.Module>"), None) == (
        "zero-core: rank 0: same error as rank 3 (printed by that rank; ZERO_CORE_DEBUG=1 "
        "prints every rank's traceback)\n")


def test_a_zero_core_errors_causes_are_named(markers):
    try:
        try:
            open(os.path.join(str(markers), "missing", "file"))
        except OSError as io:
            raise ConfigError("cannot read the config file; check the path") from io
    except ConfigError as exc:
        text = _report(0).render(type(exc), exc, exc.__traceback__)
    assert "  caused by FileNotFoundError: [Errno 2]" in text and "Traceback" not in text


def test_the_hook_never_raises(markers, capsys):
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("broken __str__")

    seen = []
    hook = _report(0, previous=lambda *a: seen.append(a))
    exc = Unprintable()
    hook(Unprintable, exc, None)  # rendering fails: Python's hook reports it instead
    assert seen == [(Unprintable, exc, None)]
    hook(KeyError, KeyError("k"), None)
    assert "zero-core: rank 0 failed: KeyError: 'k'" in capsys.readouterr().err
    assert len(seen) == 1


def test_debug_set_after_the_install_still_gives_pythons_report(markers, monkeypatch):
    seen = []
    hook = _report(0, previous=lambda *a: seen.append(a[0]))
    monkeypatch.setenv("ZERO_CORE_DEBUG", "yes")
    hook(KeyError, KeyError("k"), None)
    assert seen == [KeyError]
    assert not (markers / os.path.basename(failures.marker_root())).exists()  # no claim


def test_install_only_under_a_launcher_with_several_ranks(monkeypatch):
    for name in LAUNCH_VARS + ("ZERO_CORE_DEBUG",):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(failures, "_hook", None)
    original = sys.excepthook
    monkeypatch.setattr(sys, "excepthook", original)
    failures.install_failure_report()  # no launcher
    assert sys.excepthook is original
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    failures.install_failure_report()  # a launcher, one rank
    assert sys.excepthook is original
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ZERO_CORE_DEBUG", "1")
    failures.install_failure_report()  # debug: Python's behaviour
    assert sys.excepthook is original
    monkeypatch.setenv("ZERO_CORE_DEBUG", "maybe")
    with pytest.raises(ConfigError, match="ZERO_CORE_DEBUG='maybe' is not a yes/no value"):
        failures.install_failure_report()
    monkeypatch.setenv("ZERO_CORE_DEBUG", "0")
    failures.install_failure_report()
    hook = sys.excepthook
    assert isinstance(hook, FailureReport) and hook.previous is original and hook.rank == 0
    failures.install_failure_report()  # idempotent: not wrapped twice
    assert sys.excepthook is hook


# ---- the single-process notice ------------------------------------------------------------
NOTICE = ("zero-core: single process (world size 1): no launcher found — start with "
          "`mpirun -np N` or `torchrun --nproc-per-node N` for more ranks (silence: "
          "ZERO_CORE_QUIET=1 or config \"safety\": {\"launcher_notice\": false})\n")
SINGLE = LaunchInfo(0, 1, 0, 1, "single")


@pytest.fixture
def fresh_notice(monkeypatch):
    monkeypatch.setattr(launch_mod, "_noticed", False)
    monkeypatch.delenv("ZERO_CORE_QUIET", raising=False)


def test_the_notice_is_one_line_once_per_process(fresh_notice, capsys):
    single_process_notice(SINGLE)
    single_process_notice(SINGLE)
    assert capsys.readouterr() == ("", NOTICE)


@pytest.mark.parametrize("quiet", ["1", "true", "YES"])
def test_the_notice_is_silenced_by_zero_core_quiet(fresh_notice, monkeypatch, capsys, quiet):
    monkeypatch.setenv("ZERO_CORE_QUIET", quiet)
    single_process_notice(SINGLE)
    assert capsys.readouterr().err == ""


def test_the_notice_is_silenced_by_the_config_and_absent_under_a_launcher(fresh_notice,
                                                                          monkeypatch, capsys):
    single_process_notice(SINGLE, enabled=False)
    single_process_notice(LaunchInfo(0, 1, 0, 1, "torchrun"))   # a launcher, even of one
    single_process_notice(LaunchInfo(1, 2, 1, 2, "openmpi"))
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("ZERO_CORE_QUIET", "0")
    single_process_notice(SINGLE)
    assert capsys.readouterr().err == NOTICE
    monkeypatch.setattr(launch_mod, "_noticed", False)
    monkeypatch.setenv("ZERO_CORE_QUIET", "silence")
    with pytest.raises(ConfigError, match=r"ZERO_CORE_QUIET='silence' is not a yes/no value: "
                                          r"set it to one of 1/true/yes or 0/false/no"):
        single_process_notice(SINGLE)


def test_initialize_prints_the_notice_unless_the_config_says_not(fresh_notice, monkeypatch,
                                                                 capsys):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    config = {"train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    quiet = dict(config, safety={"launcher_notice": False})
    engine, *_ = zero_core.initialize(model=torch.nn.Linear(2, 2), config=quiet)
    engine.destroy()
    assert NOTICE not in capsys.readouterr().err
    for _ in range(2):
        engine, *_ = zero_core.initialize(model=torch.nn.Linear(2, 2), config=config)
        engine.destroy()
    assert capsys.readouterr().err.count(NOTICE) == 1
