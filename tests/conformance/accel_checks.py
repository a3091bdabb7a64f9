"""Checks of an :class:`~zero_core.interfaces.accelerator.Accelerator` (local to each rank)."""
from __future__ import annotations

import torch

from .results import Check, Recorder

#: bytes allocated to see the memory counters move: big enough to dwarf allocator noise,
#: above glibc's largest mmap threshold (32 MiB) so the CPU returns it to the OS on free
BIG_BYTES = 64 << 20


def _touch(numel: int, device) -> torch.Tensor:
    """A tensor whose pages are really committed (empty() alone may not be)."""
    return torch.ones(numel, dtype=torch.float32, device=device)


def adam_reference(p0, grad, steps, *, lr, beta1, beta2, eps, weight_decay, adamw):
    """Adam / AdamW (torch.optim semantics) on a constant gradient, in float64."""
    p, g = p0.double(), grad.double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t in range(1, steps + 1):
        gt = g if adamw else g + weight_decay * p
        if adamw:
            p = p * (1 - lr * weight_decay)
        m = beta1 * m + (1 - beta1) * gt
        v = beta2 * v + (1 - beta2) * gt * gt
        denom = v.sqrt() / (1 - beta2 ** t) ** 0.5 + eps
        p = p - lr / (1 - beta1 ** t) * m / denom
    return p


def sgd_reference(p0, grad, steps, *, lr, momentum, weight_decay):
    """SGD with momentum, no dampening (torch.optim.SGD semantics), in float64."""
    p, g = p0.double(), grad.double()
    buf = None
    for _ in range(steps):
        gt = g + weight_decay * p
        buf = gt if buf is None else momentum * buf + gt
        p = p - lr * buf
    return p


class AcceleratorChecks:
    def __init__(self, accelerator, registry, recorder: Recorder, local_rank: int = 0):
        self.acc, self.registry, self.rec = accelerator, registry, recorder
        self.local_rank = local_rank
        self.prefix = f"accelerator/{accelerator.name}"

    def identity(self, check: Check):
        acc = self.acc
        ok, why = type(acc).availability()
        check.expect(ok is True and isinstance(why, str), f"availability() = {(ok, why)!r}")
        check.expect(isinstance(acc.device_type(), str) and acc.device_type(),
                     f"device_type() = {acc.device_type()!r}")
        check.expect(acc.device_count() >= 1, f"device_count() = {acc.device_count()} on an "
                                               f"available accelerator")
        dev = acc.device(self.local_rank)
        check.expect(isinstance(dev, torch.device) and dev.type == acc.device_type(),
                     f"device({self.local_rank}) = {dev!r}, expected a {acc.device_type()} device")
        acc.set_device(self.local_rank)
        x = torch.arange(6, dtype=torch.float32, device=dev)
        check.expect(x.device.type == acc.device_type() and float(x.sum().cpu()) == 15.0,
                     f"a tensor made on {dev} is on {x.device} with sum {float(x.sum().cpu())}")
        check.expect(acc.default_comm in self.registry.communicators,
                     f"default_comm {acc.default_comm!r} is not a registered communicator "
                     f"({sorted(self.registry.communicators)})")
        facts = acc.describe()
        check.expect(isinstance(facts, dict) and facts.get("device_type") == acc.device_type(),
                     f"describe() = {facts!r}")
        check.note(f"{dev}, {acc.device_count()} device(s), default comm {acc.default_comm}")

    def memory(self, check: Check):
        """Counters are non-negative integers, allocated <= peak, and both move by about
        the size of a big tensor when it is allocated and freed."""
        acc, dev = self.acc, self.acc.device(self.local_rank)
        acc.synchronize()
        base = acc.memory_allocated()
        check.expect(isinstance(base, int) and base >= 0, f"memory_allocated() = {base!r}")
        check.expect(acc.max_memory_allocated() >= base,
                     f"peak {acc.max_memory_allocated()} < allocated {base}")
        stats = acc.memory_stats()
        check.expect(isinstance(stats, dict), f"memory_stats() = {stats!r}")
        big = _touch(BIG_BYTES // 4, dev)
        acc.synchronize()
        with_big = acc.memory_allocated()
        peak = acc.max_memory_allocated()
        check.expect(with_big - base >= BIG_BYTES // 2,
                     f"allocating {BIG_BYTES >> 20} MiB moved memory_allocated() by only "
                     f"{(with_big - base) / 2**20:.1f} MiB")
        check.expect(peak >= with_big, f"peak {peak} < allocated {with_big} with the tensor alive")
        del big
        acc.synchronize()
        after = acc.memory_allocated()
        check.expect(with_big - after >= BIG_BYTES // 2,
                     f"freeing {BIG_BYTES >> 20} MiB moved memory_allocated() by only "
                     f"{(with_big - after) / 2**20:.1f} MiB")
        # (Linux folds per-thread RSS counters lazily, so the CPU's peak may read a few
        # pages lower; it must not lose the tensor)
        check.expect(acc.max_memory_allocated() >= with_big - BIG_BYTES // 8,
                     f"the peak fell from {peak / 2**20:.1f} to "
                     f"{acc.max_memory_allocated() / 2**20:.1f} MiB when the tensor was freed "
                     f"(it must hold until reset)")
        total = acc.total_memory()
        check.expect(isinstance(total, int) and (total == 0 or total >= with_big),
                     f"total_memory() = {total!r} is below what is allocated")
        check.note(f"+{(with_big - base) / 2**20:.0f} MiB / -{(with_big - after) / 2**20:.0f} MiB")

    def reset_peak(self, check: Check):
        """After a big tensor is freed, reset_peak_memory_stats() brings the peak back
        down; a new allocation raises it again."""
        acc, dev = self.acc, self.acc.device(self.local_rank)
        big = _touch(BIG_BYTES // 4, dev)
        acc.synchronize()
        high = acc.max_memory_allocated()
        del big
        acc.synchronize()
        acc.reset_peak_memory_stats()
        low = acc.max_memory_allocated()
        check.expect(high - low >= BIG_BYTES // 2,
                     f"the peak went from {high / 2**20:.1f} MiB to {low / 2**20:.1f} MiB on "
                     f"reset after freeing {BIG_BYTES >> 20} MiB")
        check.expect(low >= acc.memory_allocated() * 0.9,
                     f"peak after reset {low} is below what is allocated {acc.memory_allocated()}")
        again = _touch(BIG_BYTES // 8, dev)
        acc.synchronize()
        check.expect(acc.max_memory_allocated() - low >= BIG_BYTES // 16,
                     "the peak did not rise with a new allocation after the reset")
        del again

    def pin_memory(self, check: Check):
        acc, dev = self.acc, self.acc.device(self.local_rank)
        host = torch.randn(1000, dtype=torch.float32)
        pinned = acc.pin_memory(host)
        check.expect(isinstance(pinned, torch.Tensor) and pinned.device.type == "cpu",
                     f"pin_memory returned {type(pinned).__name__} on "
                     f"{getattr(pinned, 'device', None)}, expected a host tensor")
        check.expect(torch.equal(pinned, host), "pin_memory changed the values")
        check.expect(isinstance(acc.is_pinned(pinned), bool), "is_pinned() is not a bool")
        on_dev = pinned.to(dev, non_blocking=True)
        acc.synchronize()
        back = on_dev.to("cpu")
        check.expect(torch.equal(back, host), "host -> device -> host round trip changed the values")
        check.note(f"pinned={acc.is_pinned(pinned)}")

    def dtypes(self, check: Check):
        """Each supported dtype computes a matmul and a reduction within its rounding."""
        acc, dev = self.acc, self.acc.device(self.local_rank)
        supported = tuple(acc.supported_dtypes())
        check.expect(torch.float32 in supported, f"supported_dtypes() {supported} lacks float32")
        g = torch.Generator().manual_seed(1234)
        for dtype in supported:
            check.expect(acc.supports_dtype(dtype), f"supports_dtype({dtype}) is False")
            a64 = torch.randn(48, 40, generator=g, dtype=torch.float64)
            b64 = torch.randn(40, 24, generator=g, dtype=torch.float64)
            a, b = a64.to(dtype).to(dev), b64.to(dtype).to(dev)
            a_r, b_r = a.cpu().double(), b.cpu().double()  # the rounded inputs, exactly
            got = (a @ b + 1.0).cpu().double()
            ref = a_r @ b_r + 1.0
            eps = torch.finfo(dtype).eps
            tol = 2 * 40 * eps * (a_r.abs() @ b_r.abs() + 1.0)
            bad = int(((got - ref).abs() > tol).sum())
            check.expect(bad == 0, f"{dtype}: {bad} matmul elements beyond rounding "
                                   f"(max error {float((got - ref).abs().max()):.3g})")
            s = a.sum().cpu().double()
            check.expect(abs(float(s - a_r.sum())) <= a.numel() * eps * float(a_r.abs().sum()),
                         f"{dtype}: sum {float(s)} vs {float(a_r.sum())}")
        check.note(", ".join(str(d).replace("torch.", "") for d in supported))

    def kernels(self, check: Check):
        """The kernel set named by the accelerator resolves through the registry and its
        Adam, AdamW and SGD steps match float64 references on the accelerator's device."""
        acc, dev = self.acc, self.acc.device(self.local_rank)
        try:
            ks = self.registry.kernel_set(acc.kernel_set)
        except Exception as exc:  # noqa: BLE001 - reported as the finding
            check.fail(f"kernel set {acc.kernel_set!r} does not resolve: {exc}")
            return
        check.expect(ks.name == acc.kernel_set, f"kernel set {acc.kernel_set!r} resolved to "
                                                f"one named {ks.name!r}")
        check.expect(callable(ks.adam_step) and callable(ks.sgd_step), "kernels are not callable")
        g = torch.Generator().manual_seed(99)
        p0, grad = torch.randn(257, generator=g), torch.randn(257, generator=g)
        hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
        for adamw in (False, True):
            p, m, v = p0.clone().to(dev), torch.zeros(257, device=dev), torch.zeros(257, device=dev)
            for step in (1, 2):
                ks.adam_step(p, grad.to(dev), m, v, step=step, adamw=adamw, **hp)
            ref = adam_reference(p0, grad, 2, adamw=adamw, **hp)
            err = float((p.cpu().double() - ref).abs().max())
            check.expect(err <= 1e-5, f"adam_step(adamw={adamw}) is {err:.3g} from the float64 "
                                      f"Adam{'W' if adamw else ''} reference after 2 steps")
        p, buf = p0.clone().to(dev), torch.zeros(257, device=dev)
        for first in (True, False):
            ks.sgd_step(p, grad.to(dev), buf, lr=0.1, momentum=0.9, dampening=0.0,
                        weight_decay=0.01, nesterov=False, first_step=first)
        ref = sgd_reference(p0, grad, 2, lr=0.1, momentum=0.9, weight_decay=0.01)
        err = float((p.cpu().double() - ref).abs().max())
        check.expect(err <= 1e-5, f"sgd_step is {err:.3g} from the float64 SGD reference after 2 steps")
        check.note(f"kernel set {ks.name}")

    def streams(self, check: Check):
        """Stream and event helpers work (or are no-ops) and computation stays correct."""
        acc, dev = self.acc, self.acc.device(self.local_rank)
        s = acc.new_stream()
        x = torch.arange(10.0, device=dev)
        with acc.stream(s):
            y = x * 2
        ev = acc.record_event()
        acc.wait_event(ev)
        acc.synchronize()
        check.expect(torch.equal(y.cpu(), torch.arange(10.0) * 2), "work on the side stream was wrong")

    def run_all(self):
        for name in ("identity", "memory", "reset_peak", "pin_memory", "dtypes", "kernels", "streams"):
            self.rec.run(f"{self.prefix}/{name}", getattr(self, name))
