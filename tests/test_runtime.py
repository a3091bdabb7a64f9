"""Registry selection order and init_distributed (single process).

Fake accelerators and communicators are registered in-process
(``registry.load(extra_modules=...)``), so the selection rules are tested on names and
priorities chosen here, independently of what hardware the machine has.
"""
from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from zero_core.runtime import registry

from zero_core.runtime import context as runtime
from zero_core.interfaces.accelerator import Accelerator
from zero_core.interfaces.communicator import Communicator, Group, Handle
from zero_core.errors import BackendUnavailable, ConfigError, PluginError
from zero_core.interfaces.hookspecs import hookimpl
from zero_core.interfaces.kernels import KernelSet

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID",
               "SLURM_NTASKS", "ZERO_CORE_ACCELERATOR", "ZERO_CORE_COMM",
               "ZERO_CORE_RANKS_PER_NODE", "ZERO_CORE_COMM_TIMEOUT")


# ---- fakes ------------------------------------------------------------------------------
def fake_accelerator(name, priority, available=True, default_comm="fake_loop"):
    class Fake(Accelerator):
        def device_type(self):
            return "cpu"

        def device_count(self):
            return 1

        def memory_allocated(self):
            return 0

        def max_memory_allocated(self):
            return 0

        def reset_peak_memory_stats(self):
            pass

        @classmethod
        def availability(cls):
            return (True, "") if available else (False, f"{name} needs the frobnicator driver")

    Fake.name, Fake.priority, Fake.default_comm = name, priority, default_comm
    Fake.kernel_set = "fake_kernels"
    Fake.__name__ = f"Fake_{name}"
    return Fake


def fake_communicator(name, available=True):
    class Loop(Communicator):
        """A one-rank world: every collective is a local copy."""

        @classmethod
        def availability(cls):
            return (True, "") if available else (False, f"{name} is switched off")

        def _init_world(self):
            return Group("world", (0,), 0, False)

        def _new_group(self, ranks, name):
            return None

        def _done(self, op, group, work=lambda: None):
            work()
            return Handle(op, group, self.timeout, wait_fn=lambda t: True)

        def _all_gather_into(self, output, input, group):
            return self._done("all_gather_into", group, lambda: output.copy_(input))

        def _reduce_scatter(self, output, input, op, group):
            return self._done("reduce_scatter", group, lambda: output.copy_(input))

        def _all_reduce(self, tensor, op, group):
            return self._done("all_reduce", group)

        def _all_to_all_single(self, output, input, group):
            return self._done("all_to_all_single", group, lambda: output.copy_(input))

        def _broadcast(self, tensor, src, group):
            return self._done("broadcast", group)

        def _barrier(self, group):
            return self._done("barrier", group)

    Loop.name = name
    Loop.__name__ = f"Loop_{name}"
    return Loop


def noop_kernel(*args, **kwargs):
    pass


def plugin_module(accelerators=(), communicators=(), kernel_sets=(), name="fake_plugin"):
    mod = types.ModuleType(name)

    @hookimpl
    def zero_core_accelerators():
        return list(accelerators)

    @hookimpl
    def zero_core_communicators():
        return list(communicators)

    @hookimpl
    def zero_core_kernel_sets():
        return list(kernel_sets)

    mod.zero_core_accelerators = zero_core_accelerators
    mod.zero_core_communicators = zero_core_communicators
    mod.zero_core_kernel_sets = zero_core_kernel_sets
    return mod


FAKE_KERNELS = KernelSet("fake_kernels", adam_step=noop_kernel, sgd_step=noop_kernel)
# priorities far above the built-ins (cuda 40) so auto-detection is decided by the fakes
HIGH = fake_accelerator("fake_high", 1000, available=False)
MID = fake_accelerator("fake_mid", 900)
LOW = fake_accelerator("fake_low", 800)
LOOP = fake_communicator("fake_loop")
LOOP2 = fake_communicator("fake_loop2")
OFF = fake_communicator("fake_off", available=False)


@pytest.fixture
def clean(monkeypatch):
    """A single process with no selection variables, fakes registered, and the runtime,
    torch.distributed and the registry cache restored afterwards."""
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    runtime.shutdown()
    reg = registry.load(refresh=True, extra_modules=[plugin_module(
        [HIGH, MID, LOW], [LOOP, LOOP2, OFF], [FAKE_KERNELS])])
    # load() does not cache a view with extras; init_distributed must select from this one
    monkeypatch.setattr(registry, "_REGISTRY", reg)
    yield reg
    runtime.shutdown()


# ---- Registry selection -------------------------------------------------------------------
def test_accelerator_explicit_beats_env_beats_auto(clean, monkeypatch):
    reg = clean
    assert reg.accelerator_class() is MID  # auto: highest priority that is available
    monkeypatch.setenv("ZERO_CORE_ACCELERATOR", "fake_low")
    assert reg.accelerator_class() is LOW
    assert reg.accelerator_class("fake_mid") is MID
    monkeypatch.setenv("ZERO_CORE_ACCELERATOR", "")  # empty is unset
    assert reg.accelerator_class() is MID


def test_communicator_explicit_beats_env_beats_default(clean, monkeypatch):
    reg = clean
    assert reg.communicator_class(default="fake_loop") is LOOP
    monkeypatch.setenv("ZERO_CORE_COMM", "fake_loop2")
    assert reg.communicator_class(default="fake_loop") is LOOP2
    assert reg.communicator_class("fake_loop", default="fake_loop2") is LOOP
    monkeypatch.delenv("ZERO_CORE_COMM")
    with pytest.raises(BackendUnavailable, match="no communicator"):
        reg.communicator_class()


def test_unknown_name_lists_what_is_registered(clean, monkeypatch):
    reg = clean
    with pytest.raises(PluginError) as err:
        reg.accelerator_class("tpu")
    msg = str(err.value)
    assert "'tpu'" in msg and "argument" in msg
    assert "fake_mid" in msg and "fake_high" in msg and "frobnicator" in msg
    monkeypatch.setenv("ZERO_CORE_COMM", "carrier_pigeon")
    with pytest.raises(PluginError) as err:
        reg.communicator_class(default="fake_loop")
    assert "'carrier_pigeon'" in str(err.value) and "ZERO_CORE_COMM" in str(err.value)


def test_unavailable_choice_says_why_and_where_it_came_from(clean, monkeypatch):
    reg = clean
    with pytest.raises(BackendUnavailable) as err:
        reg.accelerator_class("fake_high")
    msg = str(err.value)
    assert "frobnicator driver" in msg and "(registered in-process)" in msg and "fake_plugin" in msg
    monkeypatch.setenv("ZERO_CORE_COMM", "fake_off")
    with pytest.raises(BackendUnavailable, match="fake_off is switched off"):
        reg.communicator_class()


def test_no_available_accelerator(monkeypatch):
    reg = registry.Registry()
    reg.accelerators["fake_high"] = registry.Contribution("fake_high", HIGH, "p", "pkg")
    monkeypatch.delenv("ZERO_CORE_ACCELERATOR", raising=False)
    with pytest.raises(BackendUnavailable, match="no accelerator is available"):
        reg.accelerator_class()


def test_duplicate_names_are_refused():
    with pytest.raises(PluginError, match="contributed twice"):
        registry.load(refresh=True, extra_modules=[plugin_module([MID], name="one"),
                                                   plugin_module([MID], name="two")])


def test_kernel_set_lookup(clean):
    assert clean.kernel_set("fake_kernels") is FAKE_KERNELS
    with pytest.raises(PluginError, match="'nope'.*fake_kernels"):
        clean.kernel_set("nope")


# ---- init_distributed -------------------------------------------------------------------------
def test_init_explicit(clean):
    rt = runtime.init_distributed("fake_low", "fake_loop2", timeout=12, ranks_per_node=1)
    assert type(rt.accelerator) is LOW and type(rt.comm) is LOOP2
    assert (rt.rank, rt.world_size, rt.launch.launcher) == (0, 1, "single")
    assert rt.comm.timeout == 12.0 and rt.topology.ranks_per_node == 1
    assert rt.kernels is FAKE_KERNELS and rt.device.type == "cpu"
    # torch.distributed answers too, as ARCHITECTURE §3 promises
    assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
    assert runtime.get_runtime() is rt


def test_init_env_then_auto(clean, monkeypatch):
    monkeypatch.setenv("ZERO_CORE_ACCELERATOR", "fake_low")
    monkeypatch.setenv("ZERO_CORE_COMM", "fake_loop2")
    rt = runtime.init_distributed()
    assert type(rt.accelerator) is LOW and type(rt.comm) is LOOP2
    runtime.shutdown()
    assert not dist.is_initialized()
    monkeypatch.delenv("ZERO_CORE_ACCELERATOR")
    monkeypatch.delenv("ZERO_CORE_COMM")
    rt = runtime.init_distributed()
    # auto: the available accelerator of highest priority, then its default communicator
    assert type(rt.accelerator) is MID and type(rt.comm) is LOOP


def test_init_is_idempotent_and_refuses_conflicts(clean):
    rt = runtime.init_distributed("fake_mid", "fake_loop", timeout=30)
    assert runtime.init_distributed() is rt
    assert runtime.init_distributed("fake_mid", "fake_loop", timeout=30, ranks_per_node=1) is rt
    with pytest.raises(ConfigError, match="'fake_low'.*'fake_mid'"):
        runtime.init_distributed("fake_low")
    with pytest.raises(ConfigError, match="'fake_loop2'.*'fake_loop'"):
        runtime.init_distributed(comm_backend="fake_loop2")
    with pytest.raises(ConfigError, match="comm_timeout=5"):
        runtime.init_distributed(timeout=5)
    with pytest.raises(ConfigError, match="ranks_per_node=2"):
        runtime.init_distributed(ranks_per_node=2)
    assert runtime.get_runtime() is rt  # a refused call changes nothing


def test_failed_selection_leaves_no_runtime(clean):
    with pytest.raises(BackendUnavailable):
        runtime.init_distributed("fake_high")
    with pytest.raises(BackendUnavailable):
        runtime.init_distributed("fake_mid", "fake_off")
    rt = runtime.init_distributed("fake_mid", "fake_loop")
    assert type(rt.comm) is LOOP


def test_bad_topology_override(clean):
    with pytest.raises(ConfigError, match="ranks_per_node=2"):
        runtime.init_distributed("fake_mid", "fake_loop", ranks_per_node=2)


def test_comm_timeout(monkeypatch):
    monkeypatch.delenv("ZERO_CORE_COMM_TIMEOUT", raising=False)
    assert runtime.comm_timeout() == runtime.DEFAULT_TIMEOUT_S
    assert runtime.comm_timeout(7) == 7.0
    monkeypatch.setenv("ZERO_CORE_COMM_TIMEOUT", "45.5")
    assert runtime.comm_timeout() == 45.5
    assert runtime.comm_timeout(3) == 3.0  # the argument (config) beats the environment
    monkeypatch.setenv("ZERO_CORE_COMM_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="ZERO_CORE_COMM_TIMEOUT='soon'"):
        runtime.comm_timeout()
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="positive"):
            runtime.comm_timeout(bad)
