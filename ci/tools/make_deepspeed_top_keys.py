#!/usr/bin/env python
"""Write tests/fixtures/deepspeed_top_level_keys.json: the top-level config keys DeepSpeed
reads, which tests/test_from_deepspeed_table.py checks the README's "Moving from DeepSpeed"
table against (every one of them must have a row).

DeepSpeed's ``DeepSpeedConfig`` is given a config dict that records every key looked up in it;
the keys the engine reads elsewhere (the optimizer and scheduler sections, the FLOPs profiler,
the autotuner, activation checkpointing, aio, sequence parallelism) are added by name. Run in a
separate environment, never the project's (DeepSpeed is not a dependency of zero-core)::

    python -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python ci/tools/make_deepspeed_top_keys.py
"""
from __future__ import annotations

import json
import pathlib

OUT = pathlib.Path(__file__).resolve().parents[2] / "tests/fixtures/deepspeed_top_level_keys.json"
# read outside DeepSpeedConfig.__init__ (engine.py, profiling/, autotuning/, activation
# checkpointing's configure(), the aio config, sequence parallelism)
READ_ELSEWHERE = ("optimizer", "scheduler", "flops_profiler", "autotuning",
                  "activation_checkpointing", "aio", "sequence_parallel_size",
                  "load_universal_checkpoint", "use_node_local_storage")


class _Recording(dict):
    """A dict that remembers every key asked for."""
    asked: set = set()

    def get(self, key, *default):
        _Recording.asked.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        _Recording.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        _Recording.asked.add(key)
        return super().__contains__(key)


def main() -> None:
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    DeepSpeedConfig(_Recording({"train_batch_size": 1}))
    keys = sorted(_Recording.asked | set(READ_ELSEWHERE))
    OUT.write_text(json.dumps({"deepspeed": deepspeed.__version__, "keys": keys}, indent=1) + "\n")
    print(f"{len(keys)} keys -> {OUT}")


if __name__ == "__main__":
    main()
