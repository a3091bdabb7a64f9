"""``engine.save_16bit_model`` at every stage (DeepSpeed has it at stages 0-3, with
``exclude_frozen_parameters``): 2 gloo ranks train the same model on the same data at stages
0, 1, 2 and 3 and save; every stage's file holds the model's parameters in the compute dtype
(fp32 / bf16), the same values as stage 0's (ZeRO does not change the math), and without
the frozen parameter when it is excluded."""
from __future__ import annotations

import os

import pytest

from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "save16.py")
pytestmark = pytest.mark.multirank
KEYS = ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize("precision,dtype,tol", [("fp32", "torch.float32", 1e-6),
                                                 ("bf16", "torch.bfloat16", 1e-2)])
def test_every_stage_saves_the_16bit_model(tmp_path, precision, dtype, tol):
    results = run_ranks(WORKER, 2, "torchrun", args=[str(tmp_path), precision],
                        env={"ZERO_CORE_COMM": "gloo"}, timeout=300)
    rank0 = results[0].report
    reference = rank0["0"]["all"]["values"]
    for stage in ("0", "1", "2", "3"):
        for r in results:
            assert r.report[stage]["all"]["returned"] is True, stage
        saved = rank0[stage]
        assert saved["all"]["keys"] == KEYS and saved["all"]["dtypes"] == [dtype], stage
        assert saved["trainable"]["keys"] == ["0.weight", "2.bias", "2.weight"], stage
        for key in KEYS:
            a, b = saved["all"]["values"][key], reference[key]
            assert max(abs(x - y) for x, y in zip(a, b)) <= tol * max(1.0, *map(abs, b)), \
                (stage, key)
        # the frozen bias is the same at every stage, exactly
        assert saved["all"]["values"]["0.bias"] == reference["0.bias"]
