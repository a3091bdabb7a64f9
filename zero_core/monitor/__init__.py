"""DeepSpeed's monitors: the scalar events a training run reports ("Train/Samples/lr", …, each
at the global sample count) written where DeepSpeed writes them, for the config sections
``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet`` (parsed by
:mod:`zero_core.config.monitors`).

- ``master.py``: ``build_monitor(monitor_config, rank)`` — None when no section is enabled;
  else it checks on every rank that the packages the enabled writers need are installed (a
  :class:`~zero_core.errors.ConfigError` naming what to ``pip install`` otherwise) and returns
  a ``MonitorMaster`` whose ``write_events([(name, value, step), ...])`` hands the events to
  every enabled writer — on rank 0 only, as in DeepSpeed (the other ranks' have no writers);
- ``events.py``: what the writers share (the event check, the log directory, the package check);
- one module per writer: ``csv_writer.py``, ``tensorboard_writer.py``, ``wandb_writer.py``,
  ``comet_writer.py``.

Which events the engine writes, and when, is the engine's business: this package only writes.
"""
