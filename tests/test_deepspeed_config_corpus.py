"""A corpus of real DeepSpeed configs, run through ``zero_core.initialize`` (GitHub issue #14).

``tests/fixtures/deepspeed_configs/`` holds DeepSpeed JSON configs copied unchanged from public
projects (``SOURCES.json`` names the repository, path and commit of each). Every one is
trained for a few optimizer steps on a tiny model, in this process, at world size 1. Each
config must either

- run: finite losses, and the parameters change; or
- be refused with :class:`zero_core.errors.ConfigError` (a named refusal).

Anything else (another exception, a NaN loss, parameters that never move) fails the
config's own test. The summary test asserts that at least 90% of the corpus runs — the
figure issue #14 sets for zero-core being a drop-in for real DeepSpeed users.

Most configs come from Hugging Face projects and hold ``"auto"`` values, which the HF
Trainer fills from its ``TrainingArguments`` before DeepSpeed sees the config.
:func:`fill_hf_auto` fills them the same way, through zero-core's own filler
(``zero_core.integrations.transformers.fill_auto_values``, which follows transformers'
``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize``), with
fixed arguments (:data:`HF_ARGS`), so what zero-core gets is what DeepSpeed would get.

``python tests/test_deepspeed_config_corpus.py`` prints the result table in markdown.
"""
from __future__ import annotations

import copy
import json
import math
import pathlib
import sys
import tempfile
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import zero_core
from zero_core.errors import ConfigError
from zero_core.integrations.transformers import fill_auto_values

CORPUS_DIR = pathlib.Path(__file__).resolve().parent / "fixtures" / "deepspeed_configs"
SOURCES = {s["file"]: s for s in json.loads((CORPUS_DIR / "SOURCES.json").read_text())}
CONFIG_FILES = sorted(p.name for p in CORPUS_DIR.glob("*.json") if p.name != "SOURCES.json")
MIN_RUN_FRACTION = 0.9
OPTIMIZER_STEPS = 3

# --- the tiny model ----------------------------------------------------------------------------

HIDDEN = 32        # the model's "hidden_size" (what HF reads from model.config for the buckets)
IN_FEATURES, OUT_FEATURES = 16, 4


class TinyBlock(torch.nn.Module):
    """A transformer-ish block (projection, LayerNorm, residual MLP, head): 4,932 parameters,
    some below the stage-3 persistence threshold HF derives from HIDDEN (biases, LayerNorm),
    most above it, so stage 3 partitions some and keeps others whole."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(IN_FEATURES, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))
        return self.head(h)


# --- Hugging Face "auto" values ----------------------------------------------------------------

# The TrainingArguments the filling reads. transformers' defaults except the batch size (2
# instead of 8: smaller, and a value no config hard-codes by accident) and the number of
# steps (the 3 the test runs). warmup: TrainingArguments' default warmup_steps=0, which
# transformers 5.24 passes to DeepSpeed as max(1, 0) = 1 warmup step.
HF_ARGS = {
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "world_size": 1,
    "learning_rate": 5e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "warmup_steps": 0,
    "save_on_each_node": False,
    "auto_find_batch_size": False,
}

# what fill_auto_values reads from a model: config.hidden_size (HF's bucket sizes)
HF_MODEL = SimpleNamespace(config=SimpleNamespace(hidden_size=HIDDEN))


def precision_args(config: dict) -> tuple[bool, bool]:
    """(fp16, bf16) as the TrainingArguments a user of this config would pass: a config
    that hard-codes a precision is run with it (HF would otherwise report a mismatch);
    where both are "auto", bf16 (what HF recipes for current GPUs use); fp16 "auto" alone
    gets fp16 off (fp32)."""
    fp16 = (config.get("fp16") or {}).get("enabled")
    # DeepSpeed reads the bf16 section under either name; transformers' own
    # tests/deepspeed/ds_config_zero3_bf16.json uses "bfloat16"
    bf16 = (config.get("bf16") or config.get("bfloat16") or {}).get("enabled")
    want_bf16 = bf16 is True or (bf16 == "auto" and fp16 is not True)
    want_fp16 = fp16 is True and not want_bf16
    return want_fp16, want_bf16


def _explicit(config: dict, dotted: str):
    """The config's value at *dotted* unless it is missing or "auto"."""
    for key in dotted.split("."):
        config = config.get(key) if isinstance(config, dict) else None
    return None if config == "auto" else config


def user_args(raw: dict) -> tuple[SimpleNamespace, int]:
    """(the TrainingArguments a user of *raw* would pass, the run's optimizer steps).

    HF_ARGS, except where the config hard-codes a value transformers compares with an
    argument: the user's arguments say the same (transformers refuses a disagreement,
    AutoValueMismatchError here), as precision_args does for fp16/bf16. A hard-coded
    total_num_steps is the length of the user's run (the test trains its first 3 steps)."""
    args = dict(HF_ARGS)
    micro, accum = _explicit(raw, "train_micro_batch_size_per_gpu"), _explicit(raw, "gradient_accumulation_steps")
    total = _explicit(raw, "train_batch_size")
    if micro is None and total is not None:
        micro = total // (accum or 1)
    if accum is None and total is not None and micro:
        accum = total // micro
    args["per_device_train_batch_size"] = micro or args["per_device_train_batch_size"]
    args["gradient_accumulation_steps"] = accum or args["gradient_accumulation_steps"]
    for dotted, name in (("gradient_clipping", "max_grad_norm"),
                         ("scheduler.params.warmup_max_lr", "learning_rate"),
                         ("optimizer.params.lr", "learning_rate"),
                         ("optimizer.params.eps", "adam_epsilon"),
                         ("optimizer.params.weight_decay", "weight_decay"),
                         ("scheduler.params.warmup_num_steps", "warmup_steps")):
        if _explicit(raw, dotted) is not None:
            args[name] = _explicit(raw, dotted)
    betas = _explicit(raw, "optimizer.params.betas")
    if betas is not None:
        args["adam_beta1"], args["adam_beta2"] = betas
    fp16, bf16 = precision_args(raw)
    steps = _explicit(raw, "scheduler.params.total_num_steps") or OPTIMIZER_STEPS
    return SimpleNamespace(**args, fp16=fp16, bf16=bf16, fp16_full_eval=False,
                           bf16_full_eval=False), steps


def fill_hf_auto(raw: dict) -> dict:
    """A copy of *raw* as the HF Trainer hands it to DeepSpeed: its ``"auto"`` values
    filled by zero-core's :func:`zero_core.integrations.transformers.fill_auto_values`
    from :func:`user_args`. A config without "auto" is not an HF Trainer config and
    goes through unchanged (DeepSpeed's own launcher would get it as written)."""
    if autos_left(raw):
        args, steps = user_args(raw)
        config = fill_auto_values(raw, args, model=HF_MODEL, num_training_steps=steps)
    else:
        config = copy.deepcopy(raw)
    if "optimizer" not in config:
        # deepspeed_optim_sched: the Trainer builds its own optimizer (train() here passes
        # a torch AdamW) and tells DeepSpeed to accept it
        config["zero_allow_untested_optimizer"] = True
    return config


def autos_left(config, path: str = "") -> list[str]:
    """Dotted keys still holding "auto" (which DeepSpeed would get as the string)."""
    if isinstance(config, dict):
        return [k for key, v in config.items() for k in autos_left(v, f"{path}{key}.")]
    return [path.rstrip(".")] if config == "auto" else []


def redirect_nvme(config: dict, workdir: pathlib.Path) -> dict:
    """The configs' nvme_path values name their authors' disks (/nvme_data, /local_nvme):
    point them at a temporary directory of the test's instead."""
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        for section in ("offload_optimizer", "offload_param"):
            off = zero.get(section)
            if isinstance(off, dict) and off.get("nvme_path"):
                path = workdir / section
                path.mkdir(parents=True, exist_ok=True)
                off["nvme_path"] = str(path)
    return config


# --- running one config ------------------------------------------------------------------------

@dataclass
class Result:
    file: str
    repo: str
    outcome: str          # "ran" | "refused" | "crashed" | "wrong"
    reason: str           # the error's first line, or what was wrong; "" when it ran
    detail: str = ""      # the traceback of a crash

    @property
    def ok(self) -> bool:
        """The outcomes a config may have: it ran correctly, or was refused by name."""
        return self.outcome in ("ran", "refused")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _params(model) -> dict[str, torch.Tensor]:
    """Full fp32 copies of the parameters (gathered where stage 3 partitioned them)."""
    params = list(model.parameters())
    with zero_core.GatheredParameters(params):
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def train(config: dict, seed: int = 0) -> tuple[list[float], dict, dict]:
    """Initialize from *config* and run OPTIMIZER_STEPS optimizer steps; return the losses
    and the parameters before and after. Raises what initialize or training raises."""
    torch.manual_seed(seed)
    model = TinyBlock()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = None
    if "optimizer" not in config:
        # what the HF Trainer does without an optimizer section: its own torch AdamW
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=HF_ARGS["learning_rate"],
            betas=(HF_ARGS["adam_beta1"], HF_ARGS["adam_beta2"]),
            eps=HF_ARGS["adam_epsilon"], weight_decay=HF_ARGS["weight_decay"])
    engine, _, _, _ = zero_core.initialize(model=model, optimizer=optimizer,
                                           model_parameters=model.parameters(), config=config)
    losses = []
    try:
        micro = engine.config.train_micro_batch_size_per_gpu
        gen = torch.Generator().manual_seed(seed)
        for _ in range(OPTIMIZER_STEPS * engine.gradient_accumulation_steps):
            x = torch.randn(micro, IN_FEATURES, generator=gen)
            y = torch.randn(micro, OUT_FEATURES, generator=gen)
            out = engine(x.to(engine.device, engine.compute_dtype))
            loss = torch.nn.functional.mse_loss(out.float(), y.to(out.device))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        after = _params(model)
    finally:
        engine.destroy()
    return losses, before, after


def run_config(name: str, workdir: pathlib.Path) -> Result:
    """Fill, redirect and train one corpus config; classify what happened."""
    raw = json.loads((CORPUS_DIR / name).read_text())
    config = redirect_nvme(fill_hf_auto(raw), workdir / name.removesuffix(".json"))
    return classify(name, SOURCES.get(name, {}).get("repo", "?"), config)


def classify(name: str, repo: str, config: dict) -> Result:
    """Train on a ready *config*: ran, refused (ConfigError), crashed (anything else), or
    wrong (it trained, but a loss is not finite or no parameter moved)."""
    try:
        losses, before, after = train(config)
    except ConfigError as exc:
        return Result(name, repo, "refused", _first_line(exc))
    except Exception as exc:  # noqa: BLE001 — any other exception is the finding
        return Result(name, repo, "crashed", _first_line(exc), traceback.format_exc())
    if not losses or not all(math.isfinite(v) for v in losses):
        return Result(name, repo, "wrong", f"losses not finite: {losses}")
    if all(torch.equal(before[n], after[n]) for n in before):
        return Result(name, repo, "wrong", f"no parameter changed in {OPTIMIZER_STEPS} steps "
                                           f"(losses {losses})")
    return Result(name, repo, "ran", "")


# One result per config for the whole process (the parametrized tests, the summary and the
# script share them), with one runtime: zero_core.initialize reuses the process's runtime.
_RESULTS: dict[str, Result] = {}


def result_of(name: str, workdir: pathlib.Path) -> Result:
    if name not in _RESULTS:
        _RESULTS[name] = run_config(name, workdir)
    return _RESULTS[name]


def corpus_results(workdir: pathlib.Path | None = None) -> list[Result]:
    """Every corpus config's result (ran / refused with the error's first line / ...)."""
    if workdir is None:
        workdir = pathlib.Path(tempfile.mkdtemp(prefix="zero_core_corpus_"))
    return [result_of(name, workdir) for name in CONFIG_FILES]


def markdown_table(results: list[Result]) -> str:
    ran = sum(r.outcome == "ran" for r in results)
    lines = ["| config | source repo | result | reason |", "| --- | --- | --- | --- |"]
    for r in results:
        reason = r.reason.replace("|", "\\|")
        lines.append(f"| {r.file} | {r.repo} | {r.outcome} | {reason} |")
    lines.append("")
    lines.append(f"**{ran} of {len(results)} configs run ({100 * ran / len(results):.0f}%)** "
                 f"— target: {MIN_RUN_FRACTION:.0%}.")
    return "\n".join(lines)


# --- tests -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Where nvme_path points (redirect_nvme): a pytest temporary directory."""
    return tmp_path_factory.mktemp("corpus_nvme")


def test_corpus_is_recorded():
    """Every config file has its source recorded, and every record has its file; enough
    configs from enough projects that the figure means something."""
    assert set(SOURCES) == set(CONFIG_FILES)
    assert len(CONFIG_FILES) >= 35
    assert len({s["repo"] for s in SOURCES.values()}) >= 10
    for s in SOURCES.values():
        assert len(s["commit"]) == 40 and int(s["commit"], 16) >= 0, s
        assert s["file"].split("__")[0] and s["path"].endswith(".json"), s


def test_filling_matches_transformers():
    """The filled values are transformers' (a config refused for a value the filler made
    up would be a wrong finding)."""
    raw = json.loads((CORPUS_DIR / "transformers__ds_config_zero3.json").read_text())
    cfg = fill_hf_auto(raw)
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["train_batch_size"] == 2
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["gradient_clipping"] == 1.0
    assert cfg["optimizer"]["params"] == {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                          "weight_decay": 0.0}
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 5e-5,
                                          "warmup_num_steps": 1}
    z = cfg["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"],
            z["stage3_param_persistence_threshold"]) == (1024, 921, 320)
    assert cfg["fp16"]["enabled"] is False          # fp16 "auto", no bf16 section: fp32
    assert raw["fp16"]["enabled"] == "auto", "the fixture itself must stay unchanged"
    # bf16 "auto" next to fp16 "auto": bf16; a stage-2 config gets no stage-3 keys
    cfg = fill_hf_auto(json.loads((CORPUS_DIR / "llava__zero2.json").read_text()))
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert "stage3_prefetch_bucket_size" not in cfg["zero_optimization"]
    assert cfg["zero_allow_untested_optimizer"] is True     # no optimizer section
    # a hard-coded value is left as the project wrote it
    cfg = fill_hf_auto(json.loads((CORPUS_DIR / "trlx__gptj_sft.json").read_text()))
    assert cfg["scheduler"]["params"]["warmup_max_lr"] == 1e-05
    assert cfg["train_batch_size"] == 128 and cfg["fp16"]["enabled"] is True


def test_classification_catches_what_is_not_a_clean_run(monkeypatch):
    """The per-config test is only as good as classify(): a config that trains nothing is
    "wrong", a non-ConfigError exception "crashed", a ConfigError "refused"."""
    frozen = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    assert classify("lr0", "-", frozen).outcome == "wrong"
    moving = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    assert classify("lr0.1", "-", moving).outcome == "ran"
    refused = dict(moving, zero_optimization={"stage": 9})
    assert classify("stage9", "-", refused).outcome == "refused"

    def crash(config, seed=0):
        raise RuntimeError("boom")
    monkeypatch.setattr(sys.modules[__name__], "train", crash)
    r = classify("crash", "-", moving)
    assert (r.outcome, r.reason) == ("crashed", "RuntimeError: boom") and not r.ok


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_no_auto_left_after_filling(name):
    """The filler leaves no "auto" behind: HF fills every one these configs hold, so one
    left here would make a refusal below the filler's fault, not zero-core's."""
    assert autos_left(fill_hf_auto(json.loads((CORPUS_DIR / name).read_text()))) == []


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_config_runs_or_is_refused_by_name(name, workdir):
    """One config: it trains (finite losses, parameters move) or zero-core refuses it with a
    ConfigError. A crash or a wrong result fails here, under the config's name."""
    r = result_of(name, workdir)
    assert r.ok, f"{name} ({r.repo}): {r.outcome}: {r.reason}\n{r.detail}"


def test_corpus_run_fraction(workdir):
    """At least 90% of the corpus runs (issue #14). Run with -s to see the table."""
    results = corpus_results(workdir)
    print()
    print(markdown_table(results))
    ran = sum(r.outcome == "ran" for r in results)
    assert ran >= MIN_RUN_FRACTION * len(results), (
        f"{ran} of {len(results)} DeepSpeed configs run; issue #14 asks for "
        f"{MIN_RUN_FRACTION:.0%}. Refused:\n" + "\n".join(
            f"  {r.file}: {r.reason}" for r in results if r.outcome != "ran"))


if __name__ == "__main__":
    print(markdown_table(corpus_results()))
