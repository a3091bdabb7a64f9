"""Module hooks that drive stage-3 gathering: before and after each forward, and before
each module's backward.

Modules that need parameters — those with direct parameters and those with registered
external parameters (:func:`register_external_parameter`) — request their fetch units;
the hooks of the others only keep the stack of running modules (for error messages). The root module's
pre-hook also starts a new pass of the execution trace — unless it runs inside backward
(an activation-checkpoint recompute of the whole model).

While the root module's forward runs, autograd's saved-tensor hooks of saved_views.py are
installed, so that values saved for backward do not keep gathered units in memory.

Backward: the post-hook registers a gradient hook on every output tensor that requires
grad; the first of them to fire (the gradient reached the module's outputs, so its
backward is next) requests the module's units again. Tensor hooks leave the outputs
untouched, so in-place operations on them stay legal.
"""
from __future__ import annotations

import dataclasses

import torch

from zero_core.stage3.coordinator import ParamCoordinator
from zero_core.stage3.saved_views import SavedViews
from zero_core.stage3.units import FetchUnit

EXTERNAL_ATTR = "_zero_core_external_params"


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that *module*'s forward reads *parameter* although another module owns it
    (e.g. a tied output head computed as ``F.linear(x, self.embedding.weight)``). Stage 3
    then gathers it around *module*'s forward and backward too. Works before or after
    ``zero_core.initialize``; a no-op for stages 0-2."""
    if not isinstance(module, torch.nn.Module) or not isinstance(parameter, torch.nn.Parameter):
        raise TypeError("register_external_parameter(module, parameter) takes an nn.Module and "
                        "an nn.Parameter")
    params = module.__dict__.setdefault(EXTERNAL_ATTR, [])
    if all(parameter is not q for q in params):
        params.append(parameter)
    hooks = module.__dict__.get("_zero_core_stage3_hooks")
    if hooks is not None:
        hooks.add_external(module, parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    params = module.__dict__.get(EXTERNAL_ATTR, [])
    module.__dict__[EXTERNAL_ATTR] = [q for q in params if q is not parameter]
    hooks = module.__dict__.get("_zero_core_stage3_hooks")
    if hooks is not None:
        hooks.remove_external(module, parameter)


def _output_tensors(out, found: list) -> None:
    if isinstance(out, torch.Tensor):
        if out.requires_grad and out.grad_fn is not None:
            found.append(out)
    elif isinstance(out, (list, tuple)):
        for x in out:
            _output_tensors(x, found)
    elif isinstance(out, dict):
        for x in out.values():
            _output_tensors(x, found)
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        for f in dataclasses.fields(out):
            _output_tensors(getattr(out, f.name, None), found)


class ModuleHooks:
    """Installs and removes the hooks of every module of *root* that needs parameters."""

    def __init__(self, root: torch.nn.Module, coordinator: ParamCoordinator,
                 module_units: dict, unit_of_param, names: dict):
        self.root = root
        self.coord = coordinator
        self.module_units: dict[torch.nn.Module, list[FetchUnit]] = module_units
        self.unit_of_param = unit_of_param   # id(param) -> FetchUnit
        self.names = names                   # module -> qualified name
        self._handles: dict[torch.nn.Module, list] = {}
        self.saved_views = SavedViews(coordinator)
        for m in root.modules():
            for p in m.__dict__.get(EXTERNAL_ATTR, []):
                self._add_unit(m, p)
        # every module gets hooks (modules without parameters only keep the stack of running
        # modules that error messages name)
        for m in root.modules():
            self._hook(m)
        for m in list(self.module_units):
            self._hook(m)
        self._handles.setdefault(root, []).extend([
            root.register_forward_pre_hook(self._root_pre, prepend=True),
            # always_call: a forward that raises must still uninstall the saved-tensor hooks
            root.register_forward_hook(self._root_post, always_call=True)])
        for m in root.modules():
            m.__dict__["_zero_core_stage3_hooks"] = self

    # ---- external parameters -------------------------------------------------------------
    def _add_unit(self, module, p) -> None:
        u = self.unit_of_param(p)
        if u is None:
            raise TypeError(f"register_external_parameter: the parameter of shape "
                            f"{tuple(p.shape)} is not a parameter of the model this engine "
                            f"trains")
        units = self.module_units.setdefault(module, [])
        if all(u is not v for v in units):
            units.append(u)

    def add_external(self, module, p) -> None:
        self._add_unit(module, p)
        self._hook(module)

    def remove_external(self, module, p) -> None:
        owned = [q for q in module._parameters.values() if q is not None]
        keep = {id(self.unit_of_param(q)) for q in owned}
        keep.update(id(self.unit_of_param(q)) for q in module.__dict__.get(EXTERNAL_ATTR, []))
        self.module_units[module] = [u for u in self.module_units.get(module, [])
                                     if id(u) in keep]

    # ---- hooks -----------------------------------------------------------------------------
    def _hook(self, module) -> None:
        if module in self._handles and len(self._handles[module]) >= 2:
            return
        handles = self._handles.setdefault(module, [])
        handles.append(module.register_forward_pre_hook(self._pre))
        # always_call: a forward that raises still leaves the stack of running modules
        handles.append(module.register_forward_hook(self._post, always_call=True))

    def _root_pre(self, module, args):
        if not self.coord.in_backward():
            self.coord.module_stack.clear()  # a forward that raised left its entries
            self.coord.start_pass((module.training, torch.is_grad_enabled()))
        self.saved_views.enter()

    def _root_post(self, module, args, out):
        self.saved_views.exit()

    def _pre(self, module, args):
        if self.coord.whole_model_kept:
            return   # a decode step with every unit gathered: nothing to request or track
        units = self.module_units.get(module)
        self.coord.module_stack.append(self.names.get(module, type(module).__name__))
        if not units:
            return
        self.coord.before_forward(units)

    def _post(self, module, args, out):
        if self.coord.whole_model_kept:
            return
        if self.coord.module_stack:
            self.coord.module_stack.pop()
        units = self.module_units.get(module)
        if not units:
            return
        self.coord.after_forward(units)
        if torch.is_grad_enabled():
            tensors: list = []
            _output_tensors(out, tensors)
            if tensors:
                fired = [False]

                def before_backward(grad, units=units, fired=fired):
                    if not fired[0]:
                        fired[0] = True
                        self.coord.request(units)
                    return None
                for t in tensors:
                    t.register_hook(before_backward)

    def remove(self) -> None:
        for hs in self._handles.values():
            for h in hs:
                h.remove()
        self._handles.clear()
        for m in self.root.modules():
            m.__dict__.pop("_zero_core_stage3_hooks", None)
