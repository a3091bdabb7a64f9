"""Reading DeepSpeed's ``.pt`` files without DeepSpeed and without running their code.

DeepSpeed saves its checkpoints with ``torch.save``: pickles that, besides tensors and plain
containers, reference a few of DeepSpeed's own classes. Unpickling normally imports and
calls whatever a pickle names, so a planted file could run anything; zero-core never does
that. :func:`load_deepspeed_file` reads a file in two guarded passes:

1. the pickle's opcodes are scanned (nothing is executed) and every global it references
   must be in :data:`ALLOWED_GLOBALS` (tensor rebuilding, ``torch.Size``, dtypes,
   ``collections.OrderedDict``) or in :data:`DEEPSPEED_STAND_INS`; anything else is refused
   with a :class:`CheckpointError` naming the ``module.class``;
2. the file is loaded with ``torch.load(weights_only=True)`` — torch's own restricted
   unpickler — with each allow-listed DeepSpeed class mapped to a small stand-in class of
   ours (``torch.serialization.safe_globals`` with ``(StandIn, "deepspeed....Name")``
   pairs), so that the restricted unpickler builds the stand-in, with the saved attributes
   and no code of DeepSpeed's.

The DeepSpeed classes found in the files DeepSpeed 0.19.8 writes (listed by loading
tests/fixtures/deepspeed_checkpoints in an environment with DeepSpeed) and the stand-ins:

=========================================================  ==============================
``deepspeed.runtime.fp16.loss_scaler.LossScaler``          :class:`StaticLossScalerState`
``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``   :class:`DynamicLossScalerState`
``deepspeed.runtime.zero.config.ZeroStageEnum``            :class:`ZeroStage`
``deepspeed.utils.tensor_fragment.fragment_address``       :class:`FragmentAddress`
=========================================================  ==============================

``DynamicLossScaler`` appears only in fp16 checkpoints (which DeepSpeed refuses to write on
a CPU without fp16 support, so no fixture holds one); it is listed from DeepSpeed's source
(runtime/zero/stage_1_and_2.py and stage3.py save ``self.loss_scaler`` itself).
"""
from __future__ import annotations

import enum
import io
import os
import pickletools
import zipfile

import torch

from zero_core.checkpoint.store import CheckpointError
from zero_core.runtime.torch_support import safe_globals


# ---- the stand-ins ---------------------------------------------------------------------------
class _AttributeBag:
    """A stand-in restored from a pickled object's attribute dict (``__dict__``)."""

    def __setstate__(self, state):
        if not isinstance(state, dict):
            raise CheckpointError(f"a pickled {type(self).__name__} has state of type "
                                  f"{type(state).__name__}, expected a dict of attributes")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class StaticLossScalerState(_AttributeBag):
    """DeepSpeed's ``LossScaler`` (static scale; also saved in fp32/bf16 runs, scale 1):
    attributes ``cur_scale``, ``dynamic``."""


class DynamicLossScalerState(_AttributeBag):
    """DeepSpeed's ``DynamicLossScaler``: ``cur_scale``, ``cur_iter``,
    ``last_overflow_iter``, ``cur_hysteresis``, ``scale_window``, ``min_scale``,
    ``delayed_shift``, ``consecutive_hysteresis``, ..."""


class FragmentAddress(_AttributeBag):
    """DeepSpeed's ``fragment_address`` (``numel``, ``start``): where a parameter's piece
    lies in a rank's flat partition (informational; the layout is recomputed)."""


class ZeroStage(int, enum.Enum):
    """DeepSpeed's ``ZeroStageEnum`` (an int enum, pickled as ``ZeroStageEnum(value)``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 4


#: "module.Name" as the pickle spells it -> our stand-in
DEEPSPEED_STAND_INS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": StaticLossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScalerState,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}

_STORAGES = ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte",
             "Bool")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
           "uint8", "bool")
#: globals besides the stand-ins that a DeepSpeed file may reference: tensor and storage
#: rebuilding, shapes, dtypes, devices, ordered dicts (all handled by torch's restricted
#: unpickler, which refuses anything else too)
ALLOWED_GLOBALS = frozenset(
    ["collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
     "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
     "torch._tensor._rebuild_from_type_v2", "torch.Tensor", "torch.nn.parameter.Parameter",
     "torch.Size", "torch.device", "builtins.set", "_codecs.encode"]
    + [f"torch.{s}Storage" for s in _STORAGES] + [f"torch.{d}" for d in _DTYPES])


# ---- pass 1: the opcode scan ---------------------------------------------------------------------
def pickle_globals(data: bytes) -> list[str]:
    """Every ``module.name`` a pickle references (``GLOBAL``/``INST`` and ``STACK_GLOBAL``),
    found by reading its opcodes without executing any."""
    names, memo, strings = [], {}, []
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            kind = op.name
            if kind in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", ".", 1))
            elif kind in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE",
                          "SHORT_BINSTRING", "BINSTRING", "STRING"):
                strings.append(arg)
            elif kind == "MEMOIZE":
                memo[len(memo)] = strings[-1] if strings else None
            elif kind in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = strings[-1] if strings else None
            elif kind in ("GET", "BINGET", "LONG_BINGET"):
                strings.append(memo.get(arg))
            elif kind == "STACK_GLOBAL":
                module, name = (strings[-2], strings[-1]) if len(strings) >= 2 else (None, None)
                if not isinstance(module, str) or not isinstance(name, str):
                    names.append("<a global built on the stack>")
                else:
                    names.append(f"{module}.{name}")
    except Exception as exc:  # truncated or not a pickle
        raise CheckpointError(f"cannot read the pickle ({type(exc).__name__}: {exc})") from None
    return names


def _pickle_bytes(path: str) -> list[bytes]:
    """The pickles of a torch.save file: ``data.pkl`` of the zip format; for the legacy
    format, the whole file (the scan reads its leading pickles)."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            found = [n for n in z.namelist() if n.endswith("data.pkl")]
            if len(found) != 1:
                raise CheckpointError(f"{path}: expected one data.pkl in the torch zip file, "
                                      f"found {len(found)}: the file is damaged or not written "
                                      f"by torch.save")
            return [z.read(found[0])]
    with open(path, "rb") as fh:
        data = fh.read()
    if not data.startswith(b"\x80"):
        raise CheckpointError(f"{path} is not a torch.save file (neither torch's zip format "
                              f"nor a pickle): it is damaged or was not written by DeepSpeed")
    out, pos = [], 0
    for _ in range(5):  # legacy: magic, protocol, sys info, the object, storage keys
        buf = io.BytesIO(data[pos:])
        try:
            for _op in pickletools.genops(buf):
                pass
        except Exception:
            break
        out.append(data[pos:pos + buf.tell()])
        pos += buf.tell()
    return out


def check_globals(path: str) -> None:
    """Refuse *path* if its pickle references a global outside the allow-lists."""
    for data in _pickle_bytes(path):
        for name in pickle_globals(data):
            if name not in ALLOWED_GLOBALS and name not in DEEPSPEED_STAND_INS:
                raise CheckpointError(
                    f"{path} references {name}, which zero-core does not load: a DeepSpeed "
                    f"checkpoint file holds tensors, plain containers and a few known "
                    f"DeepSpeed classes ({', '.join(sorted(DEEPSPEED_STAND_INS))}), and "
                    f"unpickling anything else could run code. If the file comes from a "
                    f"source you trust and a newer DeepSpeed, convert it with DeepSpeed's "
                    f"zero_to_fp32.py there; otherwise do not load it")


# ---- pass 2: torch's restricted unpickler with the stand-ins -----------------------------------
def load_deepspeed_file(path: str, mmap: bool = True):
    """The object saved in DeepSpeed file *path* (see the module docstring), tensors on the
    CPU (memory-mapped where the format allows)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist")
    check_globals(path)
    pairs = [(cls, name) for name, cls in DEEPSPEED_STAND_INS.items()]
    use_mmap = mmap and zipfile.is_zipfile(path)
    try:
        with safe_globals(pairs):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=use_mmap)
    except CheckpointError:
        raise
    except Exception as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0] if lines else "")
        raise CheckpointError(f"{path} could not be read by the restricted unpickler "
                              f"({type(exc).__name__}: {why[:300]}): it is damaged or holds "
                              f"something other than DeepSpeed's checkpoint data") from None


def to_plain(obj, where: str = "client_state"):
    """*obj* with the stand-ins replaced by plain values (dicts of their attributes, ints for
    the stage enum) and OrderedDicts by dicts, so that it can be returned to the user and
    saved again in a zero-core checkpoint."""
    if isinstance(obj, ZeroStage):
        return int(obj)
    if isinstance(obj, _AttributeBag):
        return {k: to_plain(v, where) for k, v in obj.__dict__.items()}
    if isinstance(obj, dict):
        return {k: to_plain(v, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_plain(v, where) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(to_plain(v, where) for v in obj)
    return obj
