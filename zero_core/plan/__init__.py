"""``zero-core plan``: predict, before a run, what each ZeRO configuration costs on a cluster.

One module per job:

- ``model.py``     what is trained: a :class:`ModelSpec` from an HF ``config.json``, a preset
                   of ``examples/gpt.py`` or explicit dimensions; Ψ exact, from a shape model
                   built on the meta device (so stage 3's fetch units are the engine's own);
- ``cluster.py``   where it runs: :class:`Cluster` (ranks, memory, disk, bandwidths, FLOP
                   rate) and its presets ("this-machine", "gpu-cluster");
- ``memory.py``    bytes per rank: model states (``zero_core.memory``'s formulas on the
                   engine's own padded layout), offload, hpZ, activations, buffers;
- ``comm.py``      bytes per rank and step by link class (``zero_core.memory`` and
                   ``zero_core.zeropp.volume``): one node, flat or node-aware collectives
                   across nodes, MiCS's shard groups and its all-reduce across copies;
- ``step_time.py`` predicted step time from those bytes and the cluster's rates (never
                   shorter than its compute or its communication alone);
- ``planner.py``   the candidates (stage × offload × ZeRO++; node-aware and MiCS(G = ranks
                   per node) on several nodes), their ranking and the recommended
                   DeepSpeed-style config;
- ``render.py``    the text table and the JSON the command prints;
- ``measure.py``   ``--measure``: a matmul, the disk and collectives timed here
                   (``measure_worker.py`` is the 2-rank collective timer it launches).
"""
