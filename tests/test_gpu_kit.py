"""The GPU kit (ci/gpu/check.py) dry-run on the CPU: the kit's own code paths run, its
report files are written, and every check that can run here passes.

On the GPU machine the kit runs as ``bash ci/gpu_check.sh``; here ``--device cpu`` uses
the cpu accelerator and gloo (Triton under its interpreter) and ``--quick`` shrinks the
sizes, so the whole run stays well under a minute on 2 cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(REPO, "ci", "gpu", "check.py")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_kit")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "ZERO_CORE_ACCELERATOR", "ZERO_CORE_COMM", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, KIT, "--device", "cpu", "--quick", "--out", str(out),
                           "--budget", "200"],
                          capture_output=True, text=True, timeout=230, env=env, cwd=str(out))
    return proc, out


def test_writes_one_json_and_one_markdown_file(dry_run):
    proc, out = dry_run
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.md"], \
        (os.listdir(out), proc.stdout[-3000:], proc.stderr[-3000:])
    report = json.loads((out / "gpu_check.json").read_text())
    env = report["environment"]
    for key in ("date", "torch", "triton", "python", "git_commit"):
        assert key in env, key
    assert report["device"] == "cpu" and report["quick"] is True
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# zero-core GPU kit")
    for check in report["checks"]:
        assert f"| {check['name']} | {check['status']} |" in md
        assert set(check) >= {"name", "status", "seconds", "numbers", "detail"}


def test_every_check_that_can_run_on_the_cpu_passes(dry_run):
    proc, out = dry_run
    report = json.loads((out / "gpu_check.json").read_text())
    by_status = {}
    for check in report["checks"]:
        by_status.setdefault(check["status"], []).append(check["name"])
    failed = {c["name"]: (c.get("failures"), c.get("traceback")) for c in report["checks"]
              if c["status"] == "fail"}
    assert not failed, f"{failed}\n{proc.stdout[-4000:]}"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # nothing ran out of time; hpZ at world size 1 is refused by the config, as it must be
    assert by_status.get("skip", []) == []
    assert by_status.get("refused") == ["engine/stage3-bf16-hpz2"]
    names = set(by_status["pass"])
    for group in ("conformance/", "kernels/", "engine/", "checkpoint/", "bench/", "ranks/"):
        assert any(n.startswith(group) for n in names), group
    checks = {c["name"]: c for c in report["checks"]}
    # the Triton kernels ran (interpreted) and were compared with the reference
    triton = checks["kernels/quant-triton-bitwise"]["numbers"]
    assert triton["interpreted"] and triton["comparisons"] > 50
    assert triton["mismatched_comparisons"] == 0
    # the checkpoint saved by one engine was loaded by another process, bit for bit
    ckpt = checks["checkpoint/stage3-bf16-to-cpu"]["numbers"]
    assert ckpt["weights_compared"] > 0 and ckpt["weights_differing"] == 0
    assert ckpt["fragments_compared"] > 0 and ckpt["fragments_differing"] == 0
    # engine runs were compared with plain torch and looked at tensor placement
    stage3 = checks["engine/stage3-fp32"]["numbers"]
    assert stage3["loss_curve_max_rel_diff"] <= 1e-3
    assert stage3["placement"]["tensors_on_device"] > 0
    # 2 ranks over gloo with staging: scenarios against plain torch, a checkpoint reloaded
    ranks = checks["ranks/2-torchrun"]["numbers"]
    assert ranks["s2"]["rel_diff"] <= 1e-5 and "zpp_qgz" in ranks and "ckpt" in ranks
    # the engine's bf16 stage-3 step was profiled (synchronizations: n/a on the CPU)
    profile = checks["bench/zero-s3-bf16"]["numbers"]["profile"]
    assert profile["steps"] == 2 and profile["syncs_goal"] == 0
    assert profile["syncs_per_step_profiler"] == "n/a (cpu)"
    md = (out / "gpu_check.md").read_text()
    assert "Profiled steps" in md and "| zero-s3-bf16 |" in md


def test_the_kit_refuses_cuda_without_a_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, KIT, "--device", "cuda", "--out", "unused"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no usable CUDA GPU" in proc.stderr


def test_conformance_failures_are_read_from_the_suites_report():
    sys.path.insert(0, os.path.dirname(KIT))
    import conformance_checks
    report = {"ok": False, "aborted": "", "counts": {"pass": 1, "FAIL": 1},
              "results": {"all_reduce/sum/fp32": {"status": "FAIL", "detail": "off by 1"},
                          "barrier": {"status": "pass", "detail": ""},
                          "all_to_all/int8": {"status": "unsupported", "detail": ""}}}
    numbers, failures = conformance_checks.conformance_numbers(report)
    assert numbers["failed"] == ["all_reduce/sum/fp32"]
    assert numbers["unsupported"] == ["all_to_all/int8"]
    assert len(failures) == 1 and "off by 1" in failures[0]


# ---- the fused-optimizer check's bound: loose enough for correct float32 kernels, tight
# enough for real mistakes. The first GPU run (H100, torch 2.11) failed the check's old
# bound (64 ulps of |old| + |new|) on torch's own fused Adam: its CUDA kernel forms
# 1 - beta2 from float32 beta2, and under L2 decay g + wd * p cancels.
def _adam_float32(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay,
                  step, adamw, bias_correction, eps_inside_sqrt=False, bc2_unsquared=False,
                  decoupled_always=False, bias_eps=False):
    """Adam written out in float32 arithmetic the way a CUDA kernel does it (every
    hyperparameter a float, corrections from float pow), with switches for mistakes."""
    import torch
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    b1, b2, lr_f, eps_f, wd = f(beta1), f(beta2), f(lr), f(eps), f(weight_decay)
    g = grad.clone()
    if weight_decay and (adamw or decoupled_always):
        param.mul_(1 - lr_f * wd)
    elif weight_decay:
        g = g + wd * param
    exp_avg.copy_(b1 * exp_avg + (1 - b1) * g)
    exp_avg_sq.copy_(b2 * exp_avg_sq + (1 - b2) * g * g)
    one = f(1.0)
    bc1 = one - b1 ** step if bias_correction else one
    bc2 = one - b2 ** step if bias_correction else one
    bc2_s = bc2 if bc2_unsquared else bc2.sqrt()
    if eps_inside_sqrt:
        denom = (exp_avg_sq + eps_f).sqrt() / bc2_s
    elif bias_eps:
        denom = (exp_avg_sq.sqrt() + eps_f) / bc2_s
    else:
        denom = exp_avg_sq.sqrt() / bc2_s + eps_f
    param.sub_((lr_f / bc1) * exp_avg / denom)


def _worst_ratio(kernel, **mistake):
    """The largest difference / bound over 4 steps of every Adam variant, 200k elements."""
    import functools

    import torch
    sys.path.insert(0, os.path.dirname(KIT))
    import kernel_checks
    from zero_core.accel_kernels import optim_reference as ref
    gen = torch.Generator().manual_seed(20261127)
    worst = 0.0
    for adamw in (True, False):
        for bc in (True, False):
            for wd in (0.0, 0.1):
                n = 200_000
                state = {"param": torch.randn(n, generator=gen),
                         "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
                for step in range(1, 5):
                    scale = 10.0 ** (float(torch.rand(1, generator=gen)) * 4 - 3)
                    grad = torch.randn(n, generator=gen) * scale
                    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd,
                              step=step, adamw=adamw, bias_correction=bc)
                    mine = {k: v.clone() for k, v in state.items()}
                    want = {k: v.clone() for k, v in state.items()}
                    functools.partial(kernel, **mistake)(
                        mine["param"], grad, mine["exp_avg"], mine["exp_avg_sq"], **kw)
                    ref.adam_step(want["param"], grad, want["exp_avg"], want["exp_avg_sq"], **kw)
                    bounds = kernel_checks.adam_error_bound(state, grad, want, ulps=64, **kw)
                    for key in want:
                        diff = (mine[key].double() - want[key].double()).abs()
                        worst = max(worst, float((diff / (bounds[key] + 1e-30)).max()))
                    state = mine
    return worst


@pytest.mark.parametrize("kernel", ["float32-hyperparameters", "optim_fused", "optim_cpu"])
def test_adam_bound_accepts_correct_float32_kernels(kernel):
    from zero_core.accel_kernels import optim_cpu, optim_fused
    fn = {"float32-hyperparameters": _adam_float32, "optim_fused": optim_fused.adam_step,
          "optim_cpu": optim_cpu.adam_step}[kernel]
    assert _worst_ratio(fn) <= 1.0


@pytest.mark.parametrize("mistake", ["eps_inside_sqrt", "bc2_unsquared", "decoupled_always",
                                     "bias_eps"])
def test_adam_bound_rejects_a_wrong_formula(mistake):
    assert _worst_ratio(_adam_float32, **{mistake: True}) > 1.0
