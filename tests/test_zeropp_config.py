"""ZeRO++ configuration keys: accepted at stage 3, refused by name at stages 0-2, hpZ's
partition size checked against the world size, and round-tripped through to_dict."""
from __future__ import annotations

import json

import pytest

from zero_core.config import parse_config
from zero_core.errors import ConfigError

ALL_ON = {"zero_quantized_weights": True, "zero_quantized_nontrainable_weights": True,
          "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}


def test_stage3_accepts_every_zeropp_key_and_round_trips():
    cfg = parse_config({"zero_optimization": {"stage": 3, **ALL_ON}}, world_size=4)
    zc = cfg.zero_optimization
    assert (zc.zero_quantized_weights, zc.zero_quantized_nontrainable_weights,
            zc.zero_hpz_partition_size, zc.zero_quantized_gradients) == (True, True, 2, True)
    assert zc.zeropp_enabled
    assert parse_config(json.loads(json.dumps(cfg.to_dict())), world_size=4) == cfg
    plain = parse_config({"zero_optimization": {"stage": 3}}, world_size=4).zero_optimization
    assert not plain.zeropp_enabled and plain.zero_hpz_partition_size == 1


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("key", sorted(ALL_ON))
def test_below_stage3_each_key_is_refused_by_name(stage, key):
    with pytest.raises(ConfigError) as err:
        parse_config({"zero_optimization": {"stage": stage, key: ALL_ON[key]}}, world_size=4)
    msg = str(err.value)
    assert f"'zero_optimization.{key}'" in msg and "stage 3" in msg and f"stage {stage}" in msg


def test_switched_off_values_are_fine_at_any_stage():
    off = {"zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
           "zero_hpz_partition_size": 1, "zero_quantized_gradients": False}
    for stage in (0, 1, 2, 3):
        assert parse_config({"zero_optimization": {"stage": stage, **off}}, world_size=2) == \
            parse_config({"zero_optimization": {"stage": stage}}, world_size=2)


def test_hpz_partition_size_must_divide_the_world_and_be_positive():
    with pytest.raises(ConfigError, match=r"must divide the world size 4 \(valid: 1, 2, 4"):
        parse_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}},
                     world_size=4)
    with pytest.raises(ConfigError, match="zero_hpz_partition_size"):
        parse_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}},
                     world_size=4)
    with pytest.raises(ConfigError, match="true or false"):
        parse_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": 1}},
                     world_size=4)
