"""The vdev device itself (examples/vdev): what makes it a device and not the CPU renamed.

Each property is one a GPU has and the CPU lacks, and that the engine's device tests rely
on: separate memory reached through counted copies, refusal of mixed-device ops, garbage
(NaN) in fresh memory, its own allocator statistics and limit, pinned host memory, several
devices per process, and CPU-identical arithmetic. Independent references: the same op on
CPU tensors.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

vdev = pytest.importorskip("zero_core_vdev", reason="examples/vdev is not installed "
                           "(ci/setup_env.sh builds it)")


def test_a_device_of_its_own_with_several_indices():
    x = torch.randn(5, 3)
    for i in (0, 1, 3):
        d = x.to(f"vdev:{i}")
        assert d.device == torch.device("vdev", i) and d.is_vdev and not d.is_cpu
        assert torch.equal(d.cpu(), x)
    assert torch.vdev.device_count() >= 4
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.empty(1, device=f"vdev:{torch.vdev.device_count()}")


def test_mixing_a_vdev_and_a_host_tensor_is_refused_as_on_a_gpu():
    d, h = torch.ones(4, device="vdev"), torch.ones(4)
    with pytest.raises(RuntimeError, match="same device"):
        d + h
    with pytest.raises(RuntimeError, match="same device"):
        torch.mm(torch.ones(2, 2, device="vdev"), torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2, device="vdev:0") + torch.ones(2, device="vdev:1")
    with pytest.raises(TypeError, match="numpy"):
        d.numpy()
    # a 0-dim host scalar is allowed, as CUDA allows it
    assert torch.equal((d * torch.tensor(3.0)).cpu(), torch.full((4,), 3.0))


def test_fresh_memory_is_garbage_not_zeros():
    assert torch.isnan(torch.empty(1000, device="vdev")).all()
    assert torch.equal(torch.zeros(10, device="vdev").cpu(), torch.zeros(10))


def test_copies_between_host_and_device_are_counted():
    torch.vdev.reset_transfer_stats(2)
    before = torch.vdev.memory_stats(2)
    d = torch.randn(1000).to("vdev:2")                 # 4000 bytes in
    _ = d.cpu()                                        # 4000 bytes out
    _ = float(d.sum())                                 # one 4-byte scalar out
    after = torch.vdev.memory_stats(2)
    assert after["h2d_bytes"] - before["h2d_bytes"] == 4000
    assert after["d2h_bytes"] - before["d2h_bytes"] == 4004
    assert after["h2d_copies"] - before["h2d_copies"] == 1


def test_allocator_statistics_follow_allocations():
    dev = "vdev:3"
    torch.vdev.reset_peak_memory_stats(dev)
    base = torch.vdev.memory_allocated(dev)
    t = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    assert torch.vdev.memory_allocated(dev) - base == 1 << 20
    del t
    assert torch.vdev.memory_allocated(dev) == base
    assert torch.vdev.max_memory_allocated(dev) - base >= 1 << 20
    torch.vdev.reset_peak_memory_stats(dev)
    assert torch.vdev.max_memory_allocated(dev) == base


def test_pinned_host_memory_is_recognised():
    p = torch.randn(256).pin_memory()
    assert p.device.type == "cpu" and p.is_pinned()
    assert not torch.randn(256).is_pinned()
    assert p[10:20].is_pinned()  # a view of a pinned buffer is pinned memory too


def test_arithmetic_and_autograd_are_the_cpus_bit_for_bit():
    torch.manual_seed(0)
    x, w = torch.randn(8, 16), torch.randn(32, 16, requires_grad=True)
    wd = w.detach().to("vdev").requires_grad_()
    ln = torch.nn.LayerNorm(32)
    lnd = torch.nn.LayerNorm(32).to("vdev")
    y = ln(torch.nn.functional.linear(x, w)).tanh().sum()
    yd = lnd(torch.nn.functional.linear(x.to("vdev"), wd)).tanh().sum()
    y.backward()
    yd.backward()
    assert torch.equal(y, yd.cpu())
    assert torch.equal(w.grad, wd.grad.cpu())


def test_views_out_arguments_and_in_place_ops_stay_on_the_device():
    d = torch.arange(12.0).reshape(3, 4).to("vdev:1")
    v = d[:, 1:3]
    v.mul_(2)                                          # writes through the view
    assert torch.equal(d.cpu()[:, 1:3], torch.arange(12.0).reshape(3, 4)[:, 1:3] * 2)
    out = torch.empty(0, device="vdev:1")
    torch.cat([d, d], out=out)                         # out= resized by the kernel
    assert out.shape == (6, 4) and out.device == torch.device("vdev", 1)
    assert torch.equal(out.cpu(), torch.cat([d.cpu(), d.cpu()]))


def test_save_and_load_keep_the_device():
    d = torch.randn(6).to("vdev:1")
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    back = torch.load(buf)
    assert back.device == torch.device("vdev", 1) and torch.equal(back.cpu(), d.cpu())
    buf.seek(0)
    assert torch.load(buf, map_location="cpu").device.type == "cpu"


def test_memory_limit_gives_an_out_of_memory_error():
    code = ("import torch, zero_core_vdev\n"
            "a = torch.empty(600, dtype=torch.uint8, device='vdev')\n"
            "try:\n"
            "    torch.empty(600, dtype=torch.uint8, device='vdev')\n"
            "except torch.OutOfMemoryError as e:\n"
            "    print('OOM', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "VDEV_MEMORY_LIMIT": "1000"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "OOM" in out.stdout and "VDEV_MEMORY_LIMIT" in out.stdout and "600 bytes" in out.stdout


def test_the_accelerator_and_kernels_reach_zero_core_through_the_entry_point():
    from zero_core.runtime import registry
    reg = registry.load(refresh=True)
    contrib = reg.accelerators["vdev"]
    assert contrib.package == "zero-core-vdev"
    acc = contrib.obj()
    assert acc.device(1) == torch.device("vdev", 1)
    assert reg.kernel_set(acc.kernel_set).name == "vdev"
    # never chosen by auto-detection: installing the plugin changes nothing for CPU jobs
    assert contrib.obj.priority < reg.accelerators["cpu"].obj.priority


def test_vdev_kernels_refuse_host_buffers_and_match_the_cpu_kernels():
    from zero_core.runtime import registry
    from zero_core.accel_kernels import optim_cpu, quant_cpu
    ks = registry.load().kernel_set("vdev")
    torch.manual_seed(1)
    host = [torch.randn(300) for _ in range(2)] + [torch.zeros(300), torch.zeros(300)]
    dev = [t.to("vdev") for t in host]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1, adamw=True)
    optim_cpu.adam_step(*host, **hyper)
    ks.adam_step(*dev, **hyper)
    assert all(torch.equal(h, d.cpu()) for h, d in zip(host, dev))
    with pytest.raises(ValueError, match="must be a vdev tensor"):
        ks.adam_step(host[0], *dev[1:], **hyper)
    payload, scales = ks.extra["quantize"](dev[0], 8, 64)
    ref_payload, ref_scales = quant_cpu.quantize(host[0], 8, 64)
    assert payload.device.type == "vdev"
    assert torch.equal(payload.cpu(), ref_payload) and torch.equal(scales.cpu(), ref_scales)


def test_host_kernels_refuse_vdev_tensors_by_name():
    from zero_core.accel_kernels import optim_cpu, quant_cpu
    v = torch.randn(64, device="vdev")
    with pytest.raises(ValueError, match="CPU tensors.*vdev"):
        optim_cpu.adam_step(v, v.clone(), v.clone(), v.clone(), lr=1e-3, beta1=0.9,
                            beta2=0.99, eps=1e-8, weight_decay=0, step=1, adamw=True)
    with pytest.raises(ValueError, match="CPU tensors.*vdev"):
        quant_cpu.quantize(v, 8, 32)


def test_swap_files_refuse_device_buffers_by_name(tmp_path):
    from zero_core.offload.swap_file import SwapFile
    swap = SwapFile(str(tmp_path / "x.swap"), torch.float32, 64, [(0, 64)], direct=False)
    with pytest.raises(ValueError, match="CPU.*vdev"):
        swap.write(0, torch.zeros(64, device="vdev"))


def test_asking_for_vdev_without_the_plugin_says_how_to_install_it():
    from zero_core.runtime import registry
    from zero_core.errors import PluginError
    reg = registry.load(refresh=True)
    saved = reg.accelerators.pop("vdev")
    try:
        with pytest.raises(PluginError, match=r"unknown accelerator 'vdev'.*examples/vdev"):
            reg.accelerator_class("vdev")
    finally:
        reg.accelerators["vdev"] = saved


# ---- synchronizations, streams and the asynchronous mode (csrc/streams.h) -----------------
@pytest.fixture
def async_vdev():
    """vdev:3 as the current device, asynchronous mode on, counters zeroed; restored after."""
    was = torch.vdev.is_async()
    torch.vdev.set_async(True)
    with torch.vdev.device(3):
        torch.vdev.reset_transfer_stats(3)
        yield torch.device("vdev", 3)
    torch.vdev.set_async(was)
    torch.vdev.set_sync_debug_mode("default")


def test_synchronizations_are_counted_by_kind_as_cuda_reports_them(async_vdev):
    d = torch.arange(4.0).to(async_vdev)                 # blocking host-to-device copy
    _ = d.cpu()                                          # blocking device-to-host copy
    _ = float(d.sum())                                   # host read of a device value
    torch.vdev.synchronize(3)                            # device wait
    pinned = torch.empty(4).pin_memory()
    pinned.copy_(d, non_blocking=True)                   # not a synchronization
    d.copy_(pinned, non_blocking=True)                   # not one either
    (d * 2).sum()                                        # device work: nothing
    assert torch.vdev.sync_stats(3) == {"copies": 2, "reads": 1, "waits": 1, "total": 4}


def test_sync_debug_mode_error_names_the_operation(async_vdev):
    d = torch.ones(3, device=async_vdev)
    torch.vdev.set_sync_debug_mode("error")
    with pytest.raises(RuntimeError, match=r"synchronizing operation \(a host read"):
        d.sum().item()
    with pytest.raises(RuntimeError, match="blocking device-to-host copy of 12 bytes"):
        d.cpu()
    torch.vdev.set_sync_debug_mode("default")
    assert d.sum().item() == 3.0


def test_a_non_blocking_copy_to_the_host_lands_only_after_a_synchronization(async_vdev):
    d = torch.arange(5.0, device=async_vdev)
    host = torch.zeros(5).pin_memory()
    host.copy_(d, non_blocking=True)
    d.add_(100)                                          # later device work: not in the copy
    assert torch.isnan(host).all()                       # not there yet: a GPU race
    event = torch.vdev.Event()
    event.record()
    event.synchronize()
    assert torch.equal(host, torch.arange(5.0))          # the values at the copy's turn


def test_a_non_blocking_copy_to_the_device_reads_its_source_when_the_device_gets_there(
        async_vdev):
    src = torch.ones(4).pin_memory()
    d = torch.empty(4, device=async_vdev)
    d.copy_(src, non_blocking=True)
    src.fill_(7.0)                                       # the host overwrote it too early
    assert torch.equal((d + 0).cpu(), torch.full((4,), 7.0))
    # a pageable source is copied at once, as CUDA does
    page = torch.ones(4)
    d.copy_(page, non_blocking=True)
    page.fill_(9.0)
    assert torch.equal(d.cpu(), torch.ones(4))


def test_streams_must_be_ordered_by_events(async_vdev):
    x = torch.arange(4.0, device=async_vdev)
    default, side = torch.vdev.current_stream(3), torch.vdev.Stream(3)
    with torch.vdev.stream(side):
        with pytest.raises(RuntimeError, match="stream 0 wrote"):
            x * 2                                        # x comes from the default stream
        side.wait_stream(default)
        y = x * 2
    with pytest.raises(RuntimeError, match="has not waited for"):
        y + 1                                            # default stream, no wait: a race
    event = torch.vdev.Event()
    event.record(side)
    default.wait_event(event)
    assert torch.equal((y + 1).cpu(), torch.tensor([1.0, 3.0, 5.0, 7.0]))
    with torch.vdev.stream(side):
        z = x + 1
    default.wait_stream(side)
    assert torch.equal(z.cpu(), torch.arange(1.0, 5.0))


def test_a_result_read_at_once_costs_a_wait_one_read_later_does_not(async_vdev):
    d = torch.ones(8, device=async_vdev)
    event = torch.vdev.Event()
    event.record()
    assert not event.query()                             # just queued: the device is behind
    for _ in range(64):                                  # VDEV_QUEUE_DEPTH ops later
        d.add_(1)
    assert event.query()
    assert torch.vdev.sync_stats(3)["total"] == 0
