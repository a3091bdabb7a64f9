#!/usr/bin/env python
"""Write tests/fixtures/deepspeed_elasticity.json: DeepSpeed's own results for its
``elasticity`` config section, which tests/test_elasticity_config.py compares zero-core with.

DeepSpeed 0.19.7 is the last release with elastic training (0.19.8 removed
``deepspeed.elasticity`` and refuses the section). Run it in a separate environment, never the
project's (DeepSpeed is not a dependency of zero-core)::

    python -m venv /tmp/dsvenv7
    /tmp/dsvenv7/bin/pip install torch==2.13.0 deepspeed==0.19.7
    DS_ACCELERATOR=cpu /tmp/dsvenv7/bin/python ci/tools/make_elasticity_fixture.py

For each case of :data:`CASES` (a config, and the world sizes to try) it records

* ``plan``: what ``deepspeed.elasticity.compute_elastic_config`` returns without a world size
  — the global batch and the valid world sizes — or the error it raises. For version 0.2 that
  call needs a world size, so the plan is DeepSpeed's ``_get_compatible_gpus_v01`` called
  with the per-node arguments its version 0.2 passes (the list 0.2 keeps the global batch for);
* ``runs``: per world size, what ``deepspeed.runtime.config.DeepSpeedConfig`` resolves for a
  data-parallel group of that size (``train_batch_size``, ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps``) or the error class and message it raises.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_OUT = os.path.join(REPO, "tests", "fixtures", "deepspeed_elasticity.json")


def elastic(**kw):
    return {"enabled": True, **kw}


# (name, config, world sizes). World sizes include invalid ones on purpose.
CASES = [
    ("docs_example_v01",
     {"elasticity": elastic(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=1,
                            max_gpus=10000, min_time=20, prefer_larger_batch=True,
                            ignore_non_elastic_batch_info=False, version=0.1)},
     [1, 2, 3, 4, 5, 8, 9, 11, 16, 840, 1680]),
    ("docs_example_default_version",
     {"elasticity": elastic(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6])},
     [1, 2, 4, 9, 11, 840]),
    ("prefer_smaller_v01",
     {"elasticity": elastic(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6],
                            prefer_larger_batch=False, version=0.1)},
     [1, 2, 3, 7, 9, 13]),
    # two global batches (480, 360) tie on the number of valid world sizes
    ("tie_prefer_larger_v01",
     {"elasticity": elastic(max_train_batch_size=500, micro_batch_sizes=[3, 4], version=0.1)},
     [1, 9, 16, 45, 160]),
    ("tie_prefer_smaller_v01",
     {"elasticity": elastic(max_train_batch_size=500, micro_batch_sizes=[3, 4],
                            prefer_larger_batch=False, version=0.1)},
     [1, 9, 16, 45, 160]),
    ("gpu_range_v01",
     {"elasticity": elastic(max_train_batch_size=1024, micro_batch_sizes=[8, 16, 32], min_gpus=4,
                            max_gpus=64, version=0.1)},
     [1, 2, 4, 8, 12, 16, 32, 64, 128]),
    ("single_micro_v01",
     {"elasticity": elastic(max_train_batch_size=100, micro_batch_sizes=[3], version=0.1)},
     [1, 2, 3, 4, 5, 6, 7, 8, 12, 24, 33]),
    ("max_equals_micro_v01",
     {"elasticity": elastic(max_train_batch_size=12, micro_batch_sizes=[12, 4], version=0.1)},
     [1, 2, 3, 4, 6]),
    ("odd_micros_v01",
     {"elasticity": elastic(max_train_batch_size=5000, micro_batch_sizes=[5, 7, 9, 11],
                            min_gpus=2, max_gpus=300, version="0.1")},
     [1, 2, 3, 5, 7, 10, 11, 35, 45]),
    ("large_v01",
     {"elasticity": elastic(max_train_batch_size=1000000, micro_batch_sizes=[1, 2, 4, 8],
                            version=0.1)},
     [1, 7, 64, 1000, 10000]),
    ("nodes_of_8_v02",
     {"elasticity": elastic(max_train_batch_size=4096, micro_batch_sizes=[2, 4, 8],
                            num_gpus_per_node=8, min_gpus=8, max_gpus=256, version=0.2)},
     [1, 4, 8, 12, 16, 24, 32, 64, 256]),
    ("nodes_of_4_prefer_smaller_v02",
     {"elasticity": elastic(max_train_batch_size=3000, micro_batch_sizes=[3, 6],
                            num_gpus_per_node=4, prefer_larger_batch=False, version=0.2)},
     [2, 4, 8, 12, 20, 28]),
    ("nodes_truncated_bounds_v02",
     {"elasticity": elastic(max_train_batch_size=640, micro_batch_sizes=[4, 10],
                            num_gpus_per_node=4, min_gpus=2, max_gpus=6, version=0.2)},
     [2, 4, 8, 16, 40]),
    # refusals
    ("model_parallel_v01",
     {"elasticity": elastic(max_train_batch_size=2000, micro_batch_sizes=[2, 4],
                            model_parallel_size=2, version=0.1)}, [2]),
    ("micro_above_max",
     {"elasticity": elastic(max_train_batch_size=8, micro_batch_sizes=[2, 16], version=0.1)}, [1]),
    ("min_above_max_gpus",
     {"elasticity": elastic(max_train_batch_size=64, micro_batch_sizes=[2], min_gpus=8,
                            max_gpus=4, version=0.1)}, [4]),
    ("no_valid_world_size",
     {"elasticity": elastic(max_train_batch_size=16, micro_batch_sizes=[2], min_gpus=100,
                            version=0.1)}, [100]),
    ("missing_micro_batch_sizes",
     {"elasticity": elastic(max_train_batch_size=16)}, [1]),
    # the batch keys next to the section (DeepSpeedConfig's rule)
    ("batch_keys_refused",
     {"train_batch_size": 64, "elasticity": elastic(max_train_batch_size=2000,
                                                    micro_batch_sizes=[2, 4, 6], version=0.1)},
     [1, 2]),
    ("batch_keys_ignored",
     {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5,
      "elasticity": elastic(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=0.1,
                            ignore_non_elastic_batch_info=True)}, [1, 2, 4]),
    ("disabled_with_values",
     {"train_batch_size": 8, "elasticity": {"enabled": False, "max_train_batch_size": 100,
                                            "micro_batch_sizes": [3]}}, [1, 2]),
]


def error(exc: BaseException) -> dict:
    return {"error": type(exc).__name__, "message": str(exc)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.pop("DEEPSPEED_ELASTICITY_CONFIG", None)
    import deepspeed
    try:
        from deepspeed.elasticity import compute_elastic_config
        from deepspeed.elasticity import elasticity as ds_elasticity
    except ImportError:
        sys.exit(f"DeepSpeed {deepspeed.__version__} has no deepspeed.elasticity (removed in "
                 f"0.19.8): install deepspeed==0.19.7")
    from deepspeed.runtime import config as ds_config
    from deepspeed.utils import logger
    logger.setLevel(logging.ERROR)

    class DataParallel:  # the mpu DeepSpeedConfig asks for the data-parallel world size
        def __init__(self, size):
            self.size = size

        def get_data_parallel_world_size(self):
            return self.size

    ds_config.dist.get_rank = lambda *a, **k: 0  # no process group needed to read a config

    def plan(config: dict) -> dict:
        section = config["elasticity"]
        try:
            if float(section.get("version", 0.2)) == 0.1:
                batch, valid = compute_elastic_config(config, deepspeed.__version__)
            else:
                # version 0.2's own call (deepspeed/elasticity/elasticity.py
                # _get_compatible_gpus_v02), before its per-world-size fallback
                cfg = ds_elasticity.ElasticityConfig(section)
                per_node = cfg.num_gpus_per_node // cfg.model_parallel_size
                batch, valid = ds_elasticity._get_compatible_gpus_v01(
                    cfg.micro_batches, int(cfg.max_acceptable_batch_size / per_node),
                    int(cfg.min_gpus / cfg.num_gpus_per_node),
                    int(cfg.max_gpus / cfg.num_gpus_per_node),
                    prefer_larger=cfg.prefer_larger_batch_size)
                batch, valid = int(batch) * per_node, [v * per_node for v in valid]
            return {"train_batch_size": int(batch), "valid_world_sizes": list(valid)}
        except Exception as exc:  # noqa: BLE001 - recorded
            return error(exc)

    def run(config: dict, world_size: int) -> dict:
        try:
            c = ds_config.DeepSpeedConfig(json.loads(json.dumps(config)),
                                          mpu=DataParallel(world_size))
        except Exception as exc:  # noqa: BLE001 - recorded
            return error(exc)
        return {"train_batch_size": c.train_batch_size,
                "train_micro_batch_size_per_gpu": c.train_micro_batch_size_per_gpu,
                "gradient_accumulation_steps": c.gradient_accumulation_steps}

    cases = []
    for name, config, world_sizes in CASES:
        enabled = config["elasticity"].get("enabled", False)
        cases.append({"name": name, "config": config,
                      "plan": plan(config) if enabled else None,
                      "runs": {str(w): run(config, w) for w in world_sizes}})
    out = {"deepspeed": deepspeed.__version__,
           "generator": "ci/tools/make_elasticity_fixture.py", "cases": cases}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(cases)} cases, DeepSpeed {deepspeed.__version__}")


if __name__ == "__main__":
    main()
