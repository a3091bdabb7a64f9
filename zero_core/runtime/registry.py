"""The one plugin registry: finds accelerators, communicators and kernel sets.

Plugins are found through the ``zero_core`` entry-point group only — the built-in
backends included — so a third-party package is discovered exactly like ours.
Selection order (ARCHITECTURE §2): explicit argument / config, then ``ZERO_CORE_ACCELERATOR`` /
``ZERO_CORE_COMM``, then auto-detection by priority.
"""
from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass, field

import pluggy

from zero_core.interfaces import hookspecs
from zero_core.errors import BackendUnavailable, PluginError


#: backends that live in plugins shipped beside zero-core, and how to install each: an
#: "unknown accelerator" error for one of these names says so
KNOWN_PLUGINS = {
    "vdev": "zero-core-vdev, in examples/vdev of the zero-core repository "
            "(pip install --no-build-isolation ./examples/vdev; needs a C++ compiler)",
}


@dataclass
class Contribution:
    """One class or kernel set and where it came from."""

    name: str
    obj: object
    plugin: str        # entry-point name
    package: str       # distribution that declared the entry point


@dataclass
class Registry:
    accelerators: dict[str, Contribution] = field(default_factory=dict)
    communicators: dict[str, Contribution] = field(default_factory=dict)
    kernel_sets: dict[str, Contribution] = field(default_factory=dict)
    plugins: list[dict] = field(default_factory=list)      # name, package, module, error
    broken: list[dict] = field(default_factory=list)

    # ---- selection -------------------------------------------------------------------
    def accelerator_class(self, name: str | None = None):
        """The accelerator class to use: *name*, else ``ZERO_CORE_ACCELERATOR``, else the
        available one of highest priority."""
        source = "argument"
        if not name:
            name, source = os.environ.get("ZERO_CORE_ACCELERATOR"), "ZERO_CORE_ACCELERATOR"
        if name:
            return self._require("accelerator", self.accelerators, name, source)
        ranked = sorted(self.accelerators.values(), key=lambda c: -c.obj.priority)
        for contrib in ranked:
            if contrib.obj.availability()[0]:
                return contrib.obj
        raise BackendUnavailable("no accelerator is available:\n" + self._why_not(self.accelerators))

    def communicator_class(self, name: str | None = None, default: str | None = None):
        """The communicator class: *name*, else ``ZERO_CORE_COMM``, else *default*."""
        source = "argument"
        if not name:
            name, source = os.environ.get("ZERO_CORE_COMM"), "ZERO_CORE_COMM"
        if not name:
            name, source = default, "the accelerator's default"
        if not name:
            raise BackendUnavailable("no communicator named and no default given")
        return self._require("communicator", self.communicators, name, source)

    def kernel_set(self, name: str):
        """The KernelSet registered as *name*."""
        if name not in self.kernel_sets:
            raise PluginError(f"kernel set {name!r} is not registered; registered kernel sets: "
                              f"{sorted(self.kernel_sets)}" + self._broken_note())
        return self.kernel_sets[name].obj

    # ---- messages --------------------------------------------------------------------
    def _require(self, kind, table, name, source):
        if name not in table:
            hint = KNOWN_PLUGINS.get(name)
            hint = f" It comes from a plugin that is not installed: {hint}." if hint else ""
            raise PluginError(
                f"unknown {kind} {name!r} (from {source}).{hint} Registered {kind}s:\n"
                + self._why_not(table) + self._broken_note())
        cls = table[name].obj
        ok, why = cls.availability()
        if not ok:
            raise BackendUnavailable(
                f"{kind} {name!r} (plugin '{table[name].plugin}' from package "
                f"'{table[name].package}', selected by {source}) is not available here: {why}\n"
                f"All {kind}s:\n" + self._why_not(table))
        return cls

    @staticmethod
    def _why_not(table) -> str:
        lines = []
        for name, c in sorted(table.items()):
            ok, why = c.obj.availability()
            lines.append(f"  - {name} [{c.package}]: " + ("available" if ok else f"unavailable: {why}"))
        return "\n".join(lines) or "  (none)"

    def _broken_note(self) -> str:
        if not self.broken:
            return ""
        return "\nPlugins that failed to load:\n" + "\n".join(
            f"  - {b['name']} from package '{b['package']}' ({b['module']}): {b['error']}"
            for b in self.broken)


def _collect(pm, hook_name, table, kind, origins, registry):
    """Call *hook_name* on every registered plugin, attributing each result to its plugin."""
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        plugin_name, package, module = origins[impl.plugin_name]
        try:
            contributed = impl.function() or []
        except Exception as exc:  # a broken plugin must not hide the others
            registry.broken.append(dict(name=plugin_name, package=package, module=module,
                                        error=f"{hook_name}() raised {type(exc).__name__}: {exc}"))
            continue
        for obj in contributed:
            name = getattr(obj, "name", None)
            if not name:
                raise PluginError(f"plugin '{plugin_name}' from package '{package}' "
                                  f"contributed a {kind} without a name: {obj!r}")
            if name in table:
                other = table[name]
                raise PluginError(
                    f"{kind} {name!r} is contributed twice: by plugin '{other.plugin}' "
                    f"(package '{other.package}') and by plugin '{plugin_name}' (package "
                    f"'{package}'); uninstall one of them or rename the {kind}")
            table[name] = Contribution(name, obj, plugin_name, package)


_REGISTRY: Registry | None = None


def load(refresh: bool = False, extra_modules: list | None = None) -> Registry:
    """Discover every plugin through the ``zero_core`` entry points (cached).

    *extra_modules* registers already-imported plugin modules too (used by tests of the
    registry itself, never by the engine).
    """
    global _REGISTRY
    if _REGISTRY is not None and not refresh and not extra_modules:
        return _REGISTRY
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    origins = {}  # pluggy name -> (entry-point name, package, module path)
    for ep in md.entry_points(group=hookspecs.PROJECT):
        package = ep.dist.name if ep.dist is not None else "?"
        key = f"{package}:{ep.name}"
        if key in origins:  # the same distribution seen twice on sys.path
            continue
        try:
            pm.register(ep.load(), name=key)
        except Exception as exc:  # a broken plugin must not hide the others
            registry.broken.append(dict(name=ep.name, package=package, module=ep.value,
                                        error=f"{type(exc).__name__}: {exc}"))
            continue
        origins[key] = (ep.name, package, ep.value)
        registry.plugins.append(dict(name=ep.name, package=package, module=ep.value))
    for module in extra_modules or []:
        key = f"(in-process):{module.__name__}"
        pm.register(module, name=key)
        origins[key] = (module.__name__, "(registered in-process)", module.__name__)
        registry.plugins.append(dict(name=module.__name__, package="(registered in-process)",
                                     module=module.__name__))
    _collect(pm, "zero_core_accelerators", registry.accelerators, "accelerator", origins, registry)
    _collect(pm, "zero_core_communicators", registry.communicators, "communicator", origins, registry)
    _collect(pm, "zero_core_kernel_sets", registry.kernel_sets, "kernel set", origins, registry)
    if not extra_modules:  # an in-process extra is a test's private view: do not cache it
        _REGISTRY = registry
    return registry
