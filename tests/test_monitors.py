"""DeepSpeed's monitors (zero_core/monitor, zero_core/config/monitors.py): the four config
sections against DeepSpeed's own models, the CSV files byte for byte against what DeepSpeed's
CSV monitor wrote (tests/fixtures/deepspeed_monitors/reference.json, made by the script beside
it), TensorBoard's event files read back with tensorboard's reader, wandb and comet through
fake modules that record the calls, the missing-package errors, rank 0 only — and one
end-to-end run of the engine against the CSV files a DeepSpeed run of the same config wrote.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import types

import pytest
import torch

import zero_core
from zero_core.config.monitors import MONITOR_SECTIONS, MonitorConfig, parse_monitors
from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.monitor.master import MonitorMaster, build_monitor

REFERENCE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "deepspeed_monitors"
                        / "reference.json").read_text())


def read_tree(root: pathlib.Path) -> dict[str, str]:
    # bytes decoded as-is (no newline translation), as the reference script reads them
    return {str(p.relative_to(root)): p.read_bytes().decode()
            for p in sorted(root.rglob("*")) if p.is_file()}


def monitor_for(section: str, rank: int = 0, **keys) -> MonitorMaster | None:
    return build_monitor(parse_monitors({section: {"enabled": True, **keys}}), rank)


# ---- the config sections -------------------------------------------------------------------

def test_sections_have_deepspeeds_keys_and_defaults():
    defaults = MonitorConfig()
    assert set(MONITOR_SECTIONS) == set(REFERENCE["sections"])
    for name, deepspeed_defaults in REFERENCE["sections"].items():
        assert set(MONITOR_SECTIONS[name]) == set(deepspeed_defaults), name
        assert dataclasses.asdict(getattr(defaults, name)) == deepspeed_defaults, name
    assert parse_monitors({}) == defaults and not defaults.enabled


def test_sections_parse_every_key():
    cfg = parse_monitors({
        "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "a"},
        "csv_monitor": {"enabled": False, "output_path": "", "job_name": "b"},
        "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"},
        "comet": {"enabled": True, "samples_log_interval": 0, "project": "p", "workspace": "w",
                  "api_key": "secret-key-123", "experiment_name": "n",
                  "experiment_key": "a" * 32, "online": False, "mode": "get_or_create"},
        "optimizer": {"type": "AdamW"},      # other sections are not this parser's business
    })
    assert cfg.tensorboard.output_path == "runs/" and cfg.tensorboard.job_name == "a"
    assert (cfg.wandb.group, cfg.wandb.team, cfg.wandb.project) == ("g", "t", "p")
    assert cfg.comet.samples_log_interval == 0 and cfg.comet.online is False
    assert cfg.comet.mode == "get_or_create" and cfg.comet.api_key == "secret-key-123"
    assert cfg.enabled_sections == ("tensorboard", "wandb", "comet")
    assert "secret-key-123" not in repr(cfg)


@pytest.mark.parametrize("raw,expected", [
    ({"tensorboard": {"enabled": True, "outputpath": "x"}},
     ["unknown config key 'tensorboard.outputpath'", "did you mean 'output_path'?"]),
    ({"wandb": {"enabled": True, "entity": "me"}},
     ["unknown config key 'wandb.entity'", "valid keys in 'wandb': enabled, group, team"]),
    ({"comet": {"Samples_Log_Interval": 10}}, ["did you mean 'samples_log_interval'?"]),
    ({"csv_monitor": {"enabled": "true"}}, ["'csv_monitor.enabled'", "expected true or false"]),
    ({"csv_monitor": ["enabled"]}, ["'csv_monitor'", "expected a JSON object"]),
    ({"tensorboard": {"output_path": None}}, ["'tensorboard.output_path'", "expected a string"]),
    ({"wandb": {"project": ""}}, ["'wandb.project'", "non-empty string"]),
    ({"comet": {"samples_log_interval": -1}}, ["'comet.samples_log_interval'", ">= 0"]),
    ({"comet": {"mode": "gett"}}, ["'comet.mode'", "did you mean 'get'?"]),
    ({"comet": {"experiment_key": "short"}}, ["'comet.experiment_key'", "32 to 50"]),
    ({"comet": {"online": "yes"}}, ["'comet.online'", "expected true or false"]),
])
def test_bad_sections_are_refused_by_key(raw, expected):
    with pytest.raises(ConfigError) as err:
        parse_monitors(raw)
    for text in expected:
        assert text in str(err.value)


def test_a_bad_api_key_is_refused_without_repeating_it():
    with pytest.raises(ConfigError) as err:
        parse_monitors({"comet": {"api_key": 123456789}})
    assert "'comet.api_key'" in str(err.value) and "123456789" not in str(err.value)


# ---- building: ranks and missing packages --------------------------------------------------

def test_nothing_enabled_builds_nothing():
    assert build_monitor(None, 0) is None
    assert build_monitor(parse_monitors({"csv_monitor": {"enabled": False}}), 0) is None


def test_only_rank_0_writes(tmp_path):
    other = monitor_for("csv_monitor", rank=1, output_path=str(tmp_path))
    other.write_events([("Train/Samples/lr", 0.1, 4)])
    assert list(tmp_path.iterdir()) == []       # no folder made, nothing written
    # DeepSpeed's "enabled": any section on, the same on every rank; only rank 0 writes
    assert other.enabled and not other.writes
    with pytest.raises(ZeroCoreError):          # but events are checked everywhere
        other.write_events([("Train/Samples/lr", "0.1", 4)])
    monitor = monitor_for("csv_monitor", rank=0, output_path=str(tmp_path))
    assert monitor.enabled and monitor.writes and list(monitor.writers) == ["csv_monitor"]
    monitor.write_events([("Train/Samples/lr", 0.1, 4)])
    assert read_tree(tmp_path) == {"DeepSpeedJobName/Train_Samples_lr.csv": "step,lr\r\n4,0.1\r\n"}


def test_the_off_monitor_drops_events():
    off = MonitorMaster.off()
    off.write_events([("Train/Samples/lr", 0.1, 4)])
    assert not off.enabled and not off.writes


@pytest.mark.parametrize("section,blocked,install", [
    ("tensorboard", ["tensorboard", "torch.utils.tensorboard"], "pip install tensorboard"),
    ("wandb", ["wandb"], "pip install wandb"),
    ("comet", ["comet_ml"], 'pip install "comet_ml>=3.41.0"'),
])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_missing_package_is_a_config_error_on_every_rank(monkeypatch, tmp_path, section,
                                                           blocked, install, rank):
    for module in blocked:
        monkeypatch.setitem(sys.modules, module, None)     # import raises ImportError
    with pytest.raises(ConfigError) as err:
        monitor_for(section, rank=rank)
    assert f"'{section}.enabled'" in str(err.value) and install in str(err.value)


def test_an_old_comet_ml_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "comet_ml", types.SimpleNamespace(__version__="3.40.9"))
    with pytest.raises(ConfigError, match=r"comet_ml >= 3\.41\.0, found 3\.40\.9"):
        monitor_for("comet")


# ---- CSV -----------------------------------------------------------------------------------

def test_csv_files_are_deepspeeds_byte_for_byte(tmp_path):
    for writes in (REFERENCE["api_writes"], REFERENCE["second_run"]):   # a restart appends
        monitor = monitor_for("csv_monitor", output_path=str(tmp_path))
        for events in writes:
            monitor.write_events([tuple(e) for e in events])
    assert read_tree(tmp_path) == REFERENCE["api"]


def test_csv_default_folder_is_the_job_name_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monitor = monitor_for("csv_monitor", job_name="run7")
    monkeypatch.chdir("/")            # the folder was fixed when the monitor was built
    monitor.write_events([("Train/Samples/lr", 0.5, 2)])
    assert read_tree(tmp_path) == {"run7/Train_Samples_lr.csv": "step,lr\r\n2,0.5\r\n"}


def test_tensor_and_numpy_values_are_written_as_numbers(tmp_path):
    import numpy
    monitor = monitor_for("csv_monitor", output_path=str(tmp_path), job_name="j")
    monitor.write_events([("a/x", torch.tensor(0.25), torch.tensor(4)),
                          ("a/y", numpy.float64(0.1), numpy.int64(4)),
                          ("a/z", torch.tensor([7], dtype=torch.int32), 4)])
    assert read_tree(tmp_path) == {"j/a_x.csv": "step,x\r\n4,0.25\r\n",
                                   "j/a_y.csv": "step,y\r\n4,0.1\r\n",
                                   "j/a_z.csv": "step,z\r\n4,7\r\n"}


@pytest.mark.parametrize("event,message", [
    (("a", 1.0), "(name, value, step) tuple"),
    (("", 1.0, 1), "non-empty string"),
    (("a", "1.0", 1), "real number"),
    (("a", True, 1), "real number"),
    (("a", torch.ones(2), 1), "real number"),
    (("a", 1.0, 1.5), "the step must be an integer"),
])
def test_malformed_events_are_refused_before_anything_is_written(tmp_path, event, message):
    monitor = monitor_for("csv_monitor", output_path=str(tmp_path), job_name="j")
    with pytest.raises(ZeroCoreError, match=message.replace("(", r"\(").replace(")", r"\)")):
        monitor.write_events([("ok", 1.0, 1), event])
    assert list((tmp_path / "j").iterdir()) == []


# ---- TensorBoard ---------------------------------------------------------------------------

def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the test extra has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    monitor = monitor_for("tensorboard", output_path=str(tmp_path), job_name="tb")
    log_dir = tmp_path / "tb"
    summary_writer = monitor.writers["tensorboard"]._writer
    flushes = []
    flush = summary_writer.flush
    summary_writer.flush = lambda: (flushes.append(len(flushes)), flush())
    monitor.write_events([("Train/Samples/lr", 0.001, 4), ("Train/Samples/loss_scale", 65536.0, 4)])
    assert flushes == [0]        # one flush per write_events call (torch's writer queues)

    def scalars():
        acc = EventAccumulator(str(log_dir))
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
                for tag in acc.Tags()["scalars"]}

    # readable before the writer is closed
    assert scalars() == {"Train/Samples/lr": [(4, pytest.approx(0.001))],
                         "Train/Samples/loss_scale": [(4, 65536.0)]}
    monitor.write_events([("Train/Samples/lr", 0.0005, 8)])
    monitor.close()
    assert scalars()["Train/Samples/lr"] == [(4, pytest.approx(0.001)), (8, pytest.approx(0.0005))]
    files = [p.name for p in log_dir.iterdir()]
    assert len(files) == 1 and files[0].startswith("events.out.tfevents."), files


# ---- wandb and comet through fake modules --------------------------------------------------

class Recorder:
    """Stands in for a module or object: records every call as (name, args, kwargs)."""

    def __init__(self, calls: list, prefix: str = "", returns=None, **attrs):
        self._calls, self._prefix, self._returns = calls, prefix, returns or {}
        self.__dict__.update(attrs)

    def __getattr__(self, name):
        if name.startswith("_") and not name.startswith("__internal_api__"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            self._calls.append((self._prefix + name, args, kwargs))
            return self._returns.get(name)
        return call


def test_wandb_gets_deepspeeds_calls(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", Recorder(calls))
    monitor_for("wandb", rank=1, group="g", team="t").write_events([("a", 1.0, 1)])
    assert calls == []                         # the other ranks start no run, log nothing
    monitor = monitor_for("wandb", group="g", team="t")
    monitor.write_events([("Train/Samples/lr", 0.001, 4), ("Train/Samples/loss_scale", 8.0, 4)])
    assert calls == [
        ("init", (), {"project": "deepspeed", "group": "g", "entity": "t"}),
        ("log", ({"Train/Samples/lr": 0.001},), {"step": 4, "commit": None}),
        ("log", ({"Train/Samples/loss_scale": 8.0},), {"step": 4, "commit": None}),
    ]


@pytest.mark.parametrize("internal_api", [True, False])
def test_comet_gets_deepspeeds_calls_at_its_interval(monkeypatch, internal_api):
    calls = []
    experiment = Recorder(calls, "experiment.")
    if not internal_api:      # an older comet_ml: the public log_metric
        experiment.__dict__["__internal_api__log_metric__"] = None
    monkeypatch.setitem(sys.modules, "comet_ml", Recorder(calls, __version__="3.41.0",
                                                          returns={"start": experiment}))
    monitor = monitor_for("comet", samples_log_interval=8, project="p", experiment_name="n")
    for step in (4, 8, 12, 16, 20):
        monitor.write_events([("lr", step / 100, step)] + ([("loss", 1.0, step)] if step > 4 else []))
    log = "experiment.__internal_api__log_metric__" if internal_api else "experiment.log_metric"
    assert calls[:2] == [
        ("start", (), {"api_key": None, "project": "p", "workspace": None, "experiment_key": None,
                       "mode": None, "online": None}),
        ("experiment.set_name", ("n",), {})]
    # each name: its first event, then only once 8 more samples have passed since it was logged
    assert calls[2:] == [(log, (), {"name": n, "value": v, "step": s}) for n, v, s in [
        ("lr", 0.04, 4), ("loss", 1.0, 8), ("lr", 0.12, 12), ("loss", 1.0, 16), ("lr", 0.2, 20)]]


# ---- end to end (needs the engine wired to the monitor) ------------------------------------

@pytest.mark.parametrize("stage", [1, 3])
def test_engine_writes_deepspeeds_csv_monitor_files(tmp_path, stage):
    """The reference config run through zero_core.initialize writes the files a DeepSpeed run
    of it wrote (Train/Samples/lr at the global sample count after each optimizer step)."""
    config = json.loads(json.dumps(REFERENCE["engine_config"]))
    config["csv_monitor"]["output_path"] = str(tmp_path)
    config["zero_optimization"]["stage"] = stage
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine, _, _, _ = zero_core.initialize(model=model, config=config)
    try:
        gen = torch.Generator().manual_seed(1)
        for _ in range(REFERENCE["engine_steps"] * config["gradient_accumulation_steps"]):
            loss = engine(torch.randn(2, 4, generator=gen)).square().mean()
            engine.backward(loss)
            engine.step()
    finally:
        engine.destroy()
    assert read_tree(tmp_path) == REFERENCE["engine"]
