"""Which update rule the engine runs, and over which parameter groups.

The engine never steps a user's optimizer object directly: it reads the optimizer's class
and per-group hyperparameters and runs the same rule over its flat partitions —
through the accelerator's fused kernels for Adam/AdamW/SGD, by re-creating the same
torch.optim class over the partitions for other optimizers whose state is element-wise
(each state element depends only on the same element of parameter and gradient, so a
slice of the flat buffer can be stepped on its own), or, for the config's "Lamb"
(DeepSpeed's FusedLamb), element-wise moments plus one per-parameter trust ratio that
optim/partitioned.py assembles from every rank's fragments.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_core.errors import ConfigError

#: torch.optim classes whose update and state are element-wise (ZeRO can partition them)
ELEMENTWISE_TORCH_OPTIMIZERS = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam",
     "RMSprop", "Rprop") if hasattr(torch.optim, name))


@dataclass(frozen=True)
class UpdateRule:
    """``kind``: "adam" / "sgd" (fused kernels), "lamb" (FusedLamb: Adam moments and a
    per-parameter trust ratio, see optim/partitioned.py), "onebit_adam" / "zero_one_adam" /
    "onebit_lamb" (1-bit Adam, 0/1 Adam, 1-bit LAMB: optim/onebit.py) or "torch"
    (re-created torch.optim class).
    ``adamw``: decoupled weight decay (Adam kind). ``defaults``: hyperparameters a group
    dict may override."""

    kind: str
    adamw: bool = False
    bias_correction: bool = True
    torch_class: type | None = None
    defaults: tuple = ()  # (key, value) pairs, frozen

    def default_dict(self) -> dict:
        return dict(self.defaults)

    @property
    def state_names(self) -> tuple[str, ...]:
        """Names of the flat state buffers the rule keeps per element."""
        if self.kind in ("adam", "lamb", "onebit_adam"):
            return ("exp_avg", "exp_avg_sq")
        if self.kind == "onebit_lamb":
            return ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh")
        if self.kind == "zero_one_adam":
            return ("exp_avg", "exp_avg_sq", "momentum_accumulator")
        if self.kind == "sgd":
            return ("momentum_buffer",)
        return ()


# optimizer.type -> (rule kind, its hyperparameters beyond lr, betas, eps, weight_decay):
# the 1-bit optimizers (optim/onebit.py), in DeepSpeed's parameter names
_ONEBIT = {
    "OneBitAdam": ("onebit_adam", ("freeze_step",)),
    "OneBitLamb": ("onebit_lamb", ("max_coeff", "min_coeff", "freeze_step", "coeff_beta",
                                   "factor_max", "factor_min", "factor_threshold")),
    "ZeroOneAdam": ("zero_one_adam", ("var_freeze_step", "var_update_scaler",
                                      "local_step_scaler", "local_step_clipper")),
}


def rule_from_config(opt_cfg) -> UpdateRule:
    """The update rule of a config ``optimizer`` section (an OptimizerConfig)."""
    if opt_cfg.type in ("Adam", "AdamW"):
        adamw = opt_cfg.type == "AdamW" or opt_cfg.adamw_mode
        return UpdateRule("adam", adamw=adamw, bias_correction=opt_cfg.bias_correction,
                          defaults=(("lr", opt_cfg.lr), ("betas", tuple(opt_cfg.betas)),
                                    ("eps", opt_cfg.eps), ("weight_decay", opt_cfg.weight_decay)))
    if opt_cfg.type == "Lamb":
        # DeepSpeed's FusedLamb: weight decay enters the update (not the moments), the trust
        # ratio ||w|| / ||update|| of each parameter is clamped to [min_coeff, max_coeff]
        return UpdateRule("lamb", bias_correction=opt_cfg.bias_correction,
                          defaults=(("lr", opt_cfg.lr), ("betas", tuple(opt_cfg.betas)),
                                    ("eps", opt_cfg.eps), ("weight_decay", opt_cfg.weight_decay),
                                    ("max_coeff", opt_cfg.max_coeff),
                                    ("min_coeff", opt_cfg.min_coeff)))
    if opt_cfg.type in _ONEBIT:
        # DeepSpeed's 1-bit optimizers (optim/onebit.py): raw moments, decoupled decay
        kind, extra = _ONEBIT[opt_cfg.type]
        return UpdateRule(kind, adamw=True, bias_correction=False,
                          defaults=(("lr", opt_cfg.lr), ("betas", tuple(opt_cfg.betas)),
                                    ("eps", opt_cfg.eps), ("weight_decay", opt_cfg.weight_decay),
                                    *((name, getattr(opt_cfg, name)) for name in extra),
                                    ("comm_backend_name", opt_cfg.comm_backend_name)))
    if opt_cfg.type == "SGD":
        return UpdateRule("sgd", defaults=(("lr", opt_cfg.lr), ("momentum", opt_cfg.momentum),
                                           ("dampening", opt_cfg.dampening),
                                           ("weight_decay", opt_cfg.weight_decay),
                                           ("nesterov", opt_cfg.nesterov)))
    raise ConfigError(f"optimizer.type={opt_cfg.type!r} has no update rule in the engine; "
                      f"use Adam, AdamW, SGD or Lamb")


def require_offloadable(rule: UpdateRule) -> None:
    """Refuse, at initialize, an update rule the offloaded optimizer (zero_core/offload)
    cannot run: it steps host sub-groups one at a time with the CPU Adam/SGD kernels, and
    Lamb's trust ratio needs the norms of whole parameters before any element is updated
    (a second pass over every sub-group, which the offloaded step does not have yet)."""
    name = next((t for t, (kind, _) in _ONEBIT.items() if kind == rule.kind), None)
    if name is not None:
        raise ConfigError(
            f"optimizer.type='{name}' runs without ZeRO partitioning (stage 0), as in "
            "DeepSpeed (which refuses it with ZeRO), so not with "
            "zero_optimization.offload_optimizer: set zero_optimization.stage to 0 and remove "
            "offload_optimizer, or use Adam/AdamW with offload")
    if rule.kind == "lamb":
        raise ConfigError(
            "optimizer.type='Lamb' is not available with zero_optimization.offload_optimizer "
            "yet: the offloaded step updates host sub-groups one at a time, and Lamb's trust "
            "ratio needs every parameter's norms first. Set "
            "zero_optimization.offload_optimizer.device to 'none', or use Adam/AdamW/SGD with "
            "offload")


def resolve_user_optimizer(optimizer, model_parameters, model):
    """The optimizer passed to ``initialize``: None, a torch optimizer, or (as DeepSpeed
    accepts) a callable making one from the parameters."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):  # DeepSpeed also accepts a factory: params -> optimizer
        params = model_parameters if model_parameters is not None else model.parameters()
        made = optimizer(params)
        if isinstance(made, torch.optim.Optimizer):
            return made
    raise ConfigError(f"optimizer must be a torch.optim.Optimizer (or a callable "
                      f"returning one), got {type(optimizer).__name__}")


def rule_from_torch_optimizer(opt: torch.optim.Optimizer, stage: int) -> UpdateRule:
    """The update rule that reproduces *opt* (its class and per-group hyperparameters).

    Refuses, at stages 1 and 2, optimizers whose state is not element-wise (LBFGS,
    Adafactor, Muon, SparseAdam, subclasses we cannot inspect): their update of one element
    depends on other elements, so a rank cannot step its slice alone.
    """
    cls = type(opt)
    groups = opt.param_groups
    special = any(g.get("amsgrad") or g.get("maximize") for g in groups)
    if cls is torch.optim.Adam and not special:
        decoupled = {bool(g.get("decoupled_weight_decay", False)) for g in groups}
        if len(decoupled) == 1:
            return UpdateRule("adam", adamw=decoupled.pop())
    if cls is torch.optim.AdamW and not special:
        return UpdateRule("adam", adamw=True)
    if cls is torch.optim.SGD and not special:
        return UpdateRule("sgd")
    if cls in ELEMENTWISE_TORCH_OPTIMIZERS or stage == 0:
        return UpdateRule("torch", torch_class=cls)
    names = ", ".join(c.__name__ for c in ELEMENTWISE_TORCH_OPTIMIZERS)
    raise ConfigError(
        f"optimizer {cls.__module__}.{cls.__name__} cannot be partitioned by ZeRO stage "
        f"{stage}: the engine re-creates the optimizer over flat slices of the parameters, "
        f"which is only correct when its update and state are element-wise. Supported "
        f"classes: {names} (or the 'optimizer' config section: Adam, AdamW, SGD, Lamb). Use one "
        f"of those, or zero_optimization.stage 0, which keeps whole parameters on every rank.")


def collect_param_groups(module: torch.nn.Module, model_parameters, user_optimizer) -> list[dict]:
    """The parameter groups to train: the user optimizer's groups, else *model_parameters*
    (tensors, or dicts with ``"params"`` and per-group hyperparameters), else every
    parameter of *module*. Returns dicts whose ``"params"`` are lists of module
    parameters; raises ConfigError for a tensor that is not a parameter of the module or
    that appears in two groups."""
    if user_optimizer is not None:
        groups = user_optimizer.param_groups
    elif model_parameters is None:
        groups = [{"params": list(module.parameters())}]
    else:
        items = list(model_parameters)
        if items and all(isinstance(x, dict) for x in items):
            groups = items
        elif all(isinstance(x, torch.Tensor) for x in items):
            groups = [{"params": items}]
        else:
            raise ConfigError("model_parameters must be an iterable of parameters or of "
                              "param-group dicts ({'params': [...], 'lr': ...}), not a mix")
    names = {id(p): n for n, p in module.named_parameters()}
    seen: dict[int, int] = {}
    out = []
    for gi, group in enumerate(groups):
        if "params" not in group:
            raise ConfigError(f"param group {gi} has no 'params' key; each group is a dict "
                              f"like {{'params': [...], 'lr': 1e-3}}")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if id(p) not in names:
                raise ConfigError(
                    f"param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a "
                    f"parameter of the model; pass model.parameters() (or groups of them)")
            if id(p) in seen and seen[id(p)] != gi:
                raise ConfigError(f"parameter '{names[id(p)]}' appears in param groups "
                                  f"{seen[id(p)]} and {gi}; put each parameter in one group")
            seen[id(p)] = gi
        out.append({**group, "params": params})
    return out
