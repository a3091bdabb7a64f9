"""``zero_core.Init(remote_device=..., dtype=...)`` with DeepSpeed's meaning.

* ``remote_device`` (None, "cpu", "nvme"): where the partitions are put while the model is
  built (nvme: a preallocated, unlinked file each, mapped into memory). The config's ``offload_param.device`` overrides it when the config offloads
  parameters (as DeepSpeed does); "nvme" needs that in the config. Without parameter offload
  in the config, "cpu" only decides where the model is built: ``initialize`` moves the
  partitions to the device (DeepSpeed's engine does the same).
* ``dtype``: the dtype parameters are created and partitioned in; fp32 or the config's
  compute dtype (anything else is an error naming both).

Each case runs in process on the ``vdev`` device (examples/vdev: device memory only reached
through copies, so "the partitions are on the host" is a fact about memory, asserted from
the tensors' devices and the device audit) when it is installed, and on the CPU; training
after Init is compared bit for bit with the same model built without Init.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import zero_core
from zero_core.errors import ConfigError, ConfigWarning
from zero_core.runtime.context import shutdown
from zero_core.stage3 import GatheredParameters
from zero_core.stage3 import partitioned_params as pp
from zero_core.testing import device_audit

try:
    import zero_core_vdev  # noqa: F401  (registers the vdev device)
    ACCELERATORS = ["cpu", "vdev"]
except ImportError:   # the device tests need ci/setup_env.sh's build of examples/vdev
    ACCELERATORS = ["cpu", pytest.param("vdev", marks=pytest.mark.skip(
        reason="examples/vdev is not built: run ci/setup_env.sh"))]


@pytest.fixture(autouse=True)
def _fresh_runtime():
    yield
    shutdown()


def config(acc, precision="fp32", **zero):
    cfg = {"train_micro_batch_size_per_gpu": 2, "accelerator": acc,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
           "safety": {"launcher_notice": False}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def make(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.GELU(), torch.nn.Linear(24, 5))


def train(model, cfg, dtype=torch.float32, steps=3):
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 5, generator=g)
        loss = (engine(x.to(engine.device, dtype)).float() - y.to(engine.device)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert device_audit.misplaced(engine) == []
    with GatheredParameters(list(model.parameters())):
        values = [p.detach().float().cpu().clone() for p in model.parameters()]
    host = sum(v for k, v in device_audit.summary(engine).items() if k.startswith("host:"))
    engine.destroy()
    return losses, values, host


def own_parts(model):
    return [pp.meta_of(p).own_part for p in model.parameters()]


@pytest.mark.parametrize("acc", ACCELERATORS)
def test_remote_cpu_builds_on_the_host_and_trains_like_no_init(acc):
    seed = int(torch.randint(0, 10_000, ()))
    cfg = config(acc)
    with zero_core.Init(config=cfg, remote_device="cpu", pin_memory=True):
        model = make(seed)
    parts = own_parts(model)
    assert all(t.device.type == "cpu" for t in parts), [t.device for t in parts]
    # without remote_device the partitions are on the accelerator's device
    with zero_core.Init(config=cfg):
        on_device = make(seed)
    assert all(t.device.type == acc for t in own_parts(on_device))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(own_parts(on_device), parts))
    got = train(model, cfg)
    want = train(make(seed), cfg)
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    # no offload_param in the config: initialize moved everything to the device
    assert got[2] == want[2]


@pytest.mark.parametrize("acc", ACCELERATORS)
def test_config_offload_param_decides_where_init_puts_partitions(acc):
    """As in DeepSpeed, the config's offload_param.device wins (here: over no argument and
    over a contradicting one, with a warning); training then keeps them on the host."""
    seed = int(torch.randint(0, 10_000, ()))
    cfg = config(acc, offload_param={"device": "cpu"})
    with zero_core.Init(config=cfg):
        model = make(seed)
    assert all(t.device.type == "cpu" for t in own_parts(model))
    got = train(model, cfg)
    want = train(make(seed), config(acc))
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    if acc == "vdev":   # the partitions stayed in host memory during training
        assert got[2] > want[2]
    nvme_cfg = config(acc, offload_param={"device": "nvme", "nvme_path": "/tmp"})
    with pytest.warns(ConfigWarning, match="overridden by the config"):
        ctx = zero_core.Init(config=nvme_cfg, remote_device="cpu")
    assert ctx.remote_device == "nvme"


@pytest.mark.parametrize("acc", ACCELERATORS)
def test_dtype_creates_and_partitions_in_that_dtype(acc):
    seed = int(torch.randint(0, 10_000, ()))
    cfg = config(acc, "bf16")
    with zero_core.Init(config=cfg, dtype=torch.bfloat16, remote_device="cpu"):
        model = make(seed)
        assert torch.get_default_dtype() == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in own_parts(model))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    got = train(model, cfg, torch.bfloat16)
    # the no-Init path: the same model built in bf16 (a constructor drawing in bf16 draws
    # the same numbers rounded, so compare with the model built in bf16 directly)
    torch.set_default_dtype(torch.bfloat16)
    try:
        ref = make(seed)
    finally:
        torch.set_default_dtype(torch.float32)
    want = train(ref, cfg, torch.bfloat16)
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    # fp32 under a bf16 config: exact values, as without dtype
    with zero_core.Init(config=cfg, dtype=torch.float32):
        exact = make(seed)
    assert all(t.dtype == torch.float32 for t in own_parts(exact))


def _mapped_partition_files() -> list[str]:
    """The Init partition files this process maps (unlinked: '(deleted)')."""
    with open("/proc/self/maps") as fh:
        return sorted({line.split(None, 5)[5].strip() for line in fh
                       if "zero_core_offload." in line and ".part" in line})


@pytest.mark.parametrize("acc", ACCELERATORS)
def test_remote_nvme_builds_into_files_and_trains_like_no_init(acc, tmp_path):
    seed = int(torch.randint(0, 10_000, ()))
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_size": 1000}
    cfg = config(acc, "bf16", offload_param=nvme)
    before = _mapped_partition_files()
    with zero_core.Init(config=cfg, remote_device="nvme", dtype=torch.bfloat16):
        model = make(seed)
    parts = own_parts(model)
    assert all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in parts)
    # every partition is a mapping of its own (already unlinked) file under nvme_path
    files = [f for f in _mapped_partition_files() if f not in before]
    assert len(files) == len(parts), files
    assert all(f.startswith(str(tmp_path)) and f.endswith("(deleted)") for f in files), files
    del parts
    got = train(model, cfg, torch.bfloat16)
    # the engine copied them into its own swap files and let the mappings go
    assert [f for f in _mapped_partition_files() if f not in before] == []
    torch.set_default_dtype(torch.bfloat16)
    try:
        ref = make(seed)
    finally:
        torch.set_default_dtype(torch.float32)
    want = train(ref, config(acc, "bf16"), torch.bfloat16)
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_bad_arguments_are_named_errors():
    bf16 = config("cpu", "bf16")
    cases = [(dict(dtype=torch.float16, config=bf16), "trains in torch.bfloat16"),
             (dict(dtype=torch.bfloat16, config=config("cpu")), "trains in torch.float32"),
             (dict(dtype=torch.int8), "use torch.float32, torch.bfloat16"),
             (dict(remote_device="nvme", config=config("cpu")), "needs zero_optimization.offload_param"),
             (dict(remote_device="nvme"), "needs zero_optimization.offload_param"),
             (dict(remote_device="gpu"), "use None")]
    for kwargs, words in cases:
        with pytest.raises(ConfigError, match=words):
            zero_core.Init(**kwargs)
    # without a config Init cannot check: initialize does, naming the parameter
    with zero_core.Init(dtype=torch.float16):
        model = make(0)
    with pytest.raises(ConfigError, match=r"parameter '0.weight' was built under"):
        zero_core.initialize(model=model, config=bf16)


def test_remote_device_none_keeps_the_previous_behaviour():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        ctx = zero_core.Init(config=config("cpu"), remote_device="none")
    assert ctx.remote_device is None and ctx.dtype is None
