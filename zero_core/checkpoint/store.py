"""Atomic, verified checkpoint directories (ARCHITECTURE §6): the storage layer.

Layout of ``<save_dir>``::

    latest                    text file: the tag of the newest complete checkpoint
    <tag>/metadata.json       format version, world size, per-file SHA-256 and size, and what
                              the engine adds (model, layout, fragment index, dtypes)
    <tag>/rank_00000.safetensors   one shard per rank (safetensors: tensors + string metadata)
    <tag>/common.pt           small replicated state written by rank 0 (torch.save, plain data)
    .<tag>.partial/           a save in progress, or one a dying rank left: never read,
                              removed by the next save of the same tag (a save that fails
                              without a rank dying removes it at once)

Saving is collective (``collective_save.SaveJob``, which runs the phases, their agreement
and the clean-up of a failed save): rank 0 makes ``.<tag>.partial``; every rank writes its
files into it with :func:`write_safetensors` / :func:`write_file`, hashed while written;
rank 0 writes ``metadata.json`` and ``latest.tmp``, renames the directory into place
(:func:`move_into_place`) and only then replaces ``latest``. Files are written with plain
``os.write`` calls (:class:`_FileWriter`), so that a full disk is an ``OSError`` with its
errno and the file's name, which the save reports as its cause.

Loading (:func:`read_metadata`, :func:`open_shard`, :func:`load_plain`) checks the format
version, each file's size and SHA-256 before reading it, and never unpickles code: shards
are safetensors (read here with ``os.pread``, a few bytes at a time, so that memory stays
bounded), and the one pickle, ``common.pt``, is read with ``weights_only=True``.

The safetensors reader/writer here streams: a tensor is written from an iterable of
pieces (so a rank's fragments are never concatenated in memory) and read back in
element ranges. Files are standard safetensors (``safetensors.torch.load_file`` reads them).

All ranks must see the same filesystem (a local disk for one node, a shared one otherwise).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from typing import Callable, Iterable

import torch

from zero_core.errors import ZeroCoreError
# where it lived before the communicator's module: callers import it from here too
from zero_core.interfaces.communicator import all_gather_bytes  # noqa: F401

FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
COMMON = "common.pt"

#: safetensors dtype codes (the format's own spelling)
DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
               torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
               torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_MAX_HEADER = 100 * 2 ** 20  # bytes; a larger header is damage, not a real file


class CheckpointError(ZeroCoreError):
    """A checkpoint is missing, damaged or does not match what is being loaded."""


class CheckpointMismatchError(CheckpointError):
    """A sound checkpoint that belongs to another run: another model, other data. Resuming
    does not fall back to an older checkpoint for it (they would not match either)."""


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (how metadata.json spells dtypes)."""
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_CODES:
        raise CheckpointError(f"dtype {name!r} in checkpoint metadata is not one zero-core "
                              f"stores ({', '.join(dtype_name(d) for d in DTYPE_CODES)})")
    return dtype


# ---- files ------------------------------------------------------------------------------------
def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: str) -> None:
    """fsync directory *path* (its entries), where the OS lets a directory be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _FileWriter:
    """A new file written with plain ``os.write`` calls (small pieces gathered up to 1 MiB),
    hashed while written, fsynced by :meth:`finish`. Plain OS calls so that a full disk is an
    ``OSError`` with its errno (ENOSPC) naming this file, never a library's own wording of
    it (torch.save says "unexpected pos 1024 vs 918"); tests fail the same calls the OS would.
    Use it with ``with``: an error closes the file and names it in the OSError."""

    _GATHER = 1 << 20

    def __init__(self, path: str):
        self.path, self.size, self._sha, self._pending = path, 0, hashlib.sha256(), bytearray()
        self._fd = None
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            self._name_file(exc)
            raise

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self._sha.update(view)
        self.size += len(view)
        if len(self._pending) + len(view) > self._GATHER:
            self._drain()
        if len(view) >= self._GATHER:
            self._write_all(view)
        else:
            self._pending += view

    def _write_all(self, view: memoryview) -> None:
        while len(view):
            view = view[os.write(self._fd, view):]  # a full disk may take part of it first

    def _drain(self) -> None:
        if self._pending:
            self._write_all(memoryview(self._pending))
            self._pending = bytearray()

    def finish(self) -> tuple[str, int]:
        """Write what is gathered, fsync, close; ``(sha256 hex, bytes)``."""
        self._drain()
        os.fsync(self._fd)
        fd, self._fd = self._fd, None
        os.close(fd)
        return self._sha.hexdigest(), self.size

    def _name_file(self, exc: OSError) -> None:
        if exc.filename is None:  # os.write's errors do not say which file
            exc.filename = self.path

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass  # the error being raised says more
        if isinstance(exc, OSError):
            self._name_file(exc)
        return False


def write_file(path: str, data: bytes) -> tuple[str, int]:
    """Write *data* to the new file *path*; fsync; ``(sha256 hex, bytes)``."""
    with _FileWriter(path) as fh:
        fh.write(data)
        return fh.finish()


def write_file_atomic(path: str, data: bytes) -> None:
    """Write *data* to ``<path>.tmp``, fsync, rename over *path* (removed again on failure)."""
    tmp = path + ".tmp"
    try:
        write_file(tmp, data)
    except BaseException:
        remove_path(tmp)  # a full disk keeps no half-written temporary
        raise
    os.replace(tmp, path)


def remove_path(path: str) -> None:
    """Remove file or directory *path* if it is there (OSError if it cannot be)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def check_tag(tag) -> str:
    """*tag* as a string, if it is usable as a directory name (else CheckpointError)."""
    tag = str(tag)
    if (not tag or tag in (".", "..") or "/" in tag or os.sep in tag or tag.startswith(".")
            or tag == LATEST):
        raise CheckpointError(f"checkpoint tag {tag!r} is not usable as a directory name: use "
                              f"letters, digits, '-', '_' (e.g. 'global_step100')")
    return tag


def _check_file_name(name: str, where: str) -> str:
    # names come from metadata.json: never let one point outside the checkpoint directory
    if not isinstance(name, str) or not name or "/" in name or os.sep in name or name.startswith("."):
        raise CheckpointError(f"{where} names a file {name!r} that is not a plain file name: "
                              f"the metadata is damaged or was altered")
    return name


# ---- streaming safetensors ----------------------------------------------------------------
class TensorEntry:
    """One tensor to write: *name*, *dtype*, *shape*, and *pieces*, a callable returning an
    iterable of tensors whose elements, concatenated in order, are the tensor's values."""

    def __init__(self, name: str, dtype: torch.dtype, shape, pieces: Callable[[], Iterable[torch.Tensor]]):
        if dtype not in DTYPE_CODES:
            raise CheckpointError(f"tensor {name!r} has dtype {dtype}, which safetensors "
                                  f"shards do not carry; convert it first")
        self.name, self.dtype, self.shape, self.pieces = name, dtype, tuple(int(s) for s in shape), pieces

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    # viewed as bytes: bfloat16 and friends have no numpy type
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _tensor_bytes_writable(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor *t*, writable in place."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def write_safetensors(path: str, entries: list[TensorEntry], metadata: dict | None = None,
                      on_tensor: Callable[[TensorEntry], None] | None = None) -> tuple[str, int]:
    """Write *entries* to *path* in the safetensors format, one piece at a time; fsync.

    Returns ``(sha256 hex, size in bytes)`` of the file, hashed while writing.
    *on_tensor(entry)* is called after each tensor (progress bars).
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": DTYPE_CODES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with _FileWriter(path) as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for e in entries:
            start = fh.size
            for piece in e.pieces():
                if piece.dtype != e.dtype:
                    piece = piece.to(e.dtype)
                fh.write(_tensor_bytes(piece))
            if fh.size - start != e.nbytes:
                raise CheckpointError(f"internal error writing {path}: tensor {e.name!r} got "
                                      f"{fh.size - start} bytes from its pieces, {e.nbytes} "
                                      f"expected")
            if on_tensor is not None:
                on_tensor(e)
        return fh.finish()


class SafetensorsReader:
    """Reads tensors (or element ranges of them) from a safetensors file with ``pread``,
    after validating its header against the file size. Close it (or use ``with``)."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path} is not a valid safetensors shard: {why}")

    def _parse(self):
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._bad(f"only {size} bytes, no header")
        n = struct.unpack("<Q", head)[0]
        if n > _MAX_HEADER or 8 + n > size:
            raise self._bad(f"header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except ValueError as exc:
            raise self._bad(f"header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.tensors: dict[str, tuple[torch.dtype, tuple, int, int]] = {}
        spans = []
        for name, spec in header.items():
            try:
                dtype = CODE_DTYPES[spec["dtype"]]
                shape = tuple(int(s) for s in spec["shape"])
                begin, end = (int(x) for x in spec["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"entry {name!r} is malformed: {spec!r}") from None
            numel = 1
            for s in shape:
                if s < 0:
                    raise self._bad(f"entry {name!r} has a negative dimension")
                numel *= s
            if end - begin != numel * torch.empty((), dtype=dtype).element_size() or begin < 0:
                raise self._bad(f"entry {name!r}: offsets {begin}..{end} do not match its "
                                f"shape {list(shape)} and dtype {spec['dtype']}")
            self.tensors[name] = (dtype, shape, begin, end)
            spans.append((begin, end))
        spans.sort()
        pos = 0
        for begin, end in spans:
            if begin != pos:
                raise self._bad("tensor data overlaps or leaves holes")
            pos = end
        if self.data_start + pos != size:
            raise self._bad(f"header describes {self.data_start + pos} bytes, the file has {size}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def spec(self, name: str) -> tuple[torch.dtype, tuple]:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path} has no tensor {name!r}: the shard does not "
                                  f"match its checkpoint's metadata")
        dtype, shape, _, _ = self.tensors[name]
        return dtype, shape

    def _range(self, name: str, start: int, count: int | None):
        dtype, _ = self.spec(name)
        _, _, begin, end = self.tensors[name]
        elem = torch.empty((), dtype=dtype).element_size()
        numel = (end - begin) // elem
        count = numel - start if count is None else count
        if start < 0 or count < 0 or start + count > numel:
            raise CheckpointError(f"{self.path}: elements {start}..{start + count} of "
                                  f"{name!r} are outside its {numel} elements: the metadata "
                                  f"does not match this shard")
        return dtype, count, self.data_start + begin + start * elem

    def _pread_into(self, view: memoryview, offset: int, name: str) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(self._fd, [view[got:]], offset + got)
            if n <= 0:
                raise CheckpointError(f"{self.path} ended while reading {name!r}: truncated")
            got += n

    def read(self, name: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements ``[start, start + count)`` of tensor *name*, flattened (a new tensor)."""
        dtype, count, offset = self._range(name, start, count)
        out = torch.empty(count, dtype=torch.uint8 if dtype == torch.bool else dtype)
        if count:
            self._pread_into(_tensor_bytes_writable(out), offset, name)
        return out.to(torch.bool) if dtype == torch.bool else out

    def read_into(self, name: str, start: int, dst: torch.Tensor) -> None:
        """Copy elements ``[start, start + dst.numel())`` of *name* into *dst* — straight from
        the file when *dst* is a contiguous CPU tensor of the stored dtype (no staging copy),
        converting the dtype otherwise."""
        dtype, count, offset = self._range(name, start, dst.numel())
        if (dst.dtype == dtype and dtype != torch.bool and dst.device.type == "cpu"
                and dst.is_contiguous()):
            if count:
                self._pread_into(_tensor_bytes_writable(dst), offset, name)
        else:
            dst.copy_(self.read(name, start, count).view(dst.shape))

    def read_tensor(self, name: str) -> torch.Tensor:
        """Tensor *name* with its shape."""
        _, shape = self.spec(name)
        return self.read(name).reshape(shape)


# ---- collectives on small byte strings -------------------------------------------------------
def all_ranks_ok(comm, ok: bool) -> bool:
    """Collective: True on every rank iff *ok* on every rank (*comm* None: this rank alone)."""
    if comm is None or comm.world_size == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    comm.all_reduce(flag, op="min")
    return bool(int(flag))


def raise_unless_loaded_everywhere(comm, error: Exception | None, what: str) -> None:
    """Collective end of a load: raise this rank's *error*, or, when only another rank
    failed, say so (every rank stops; none trains on a half-loaded state)."""
    if not all_ranks_ok(comm, error is None):
        raise error or CheckpointError(
            f"loading {what} failed on another rank (see its error); this rank's state may be "
            f"partly overwritten: load again or restart")


# ---- save ---------------------------------------------------------------------------------------
def move_into_place(save_dir: str, tag: str, partial: str, final: str) -> None:
    """Rename the finished *partial* directory to *final* (replacing an earlier save of the
    tag; if that fails, the earlier one is put back)."""
    if os.path.exists(final):  # re-saving a tag: swap, never a moment with neither
        old = os.path.join(save_dir, f".{tag}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        try:
            os.replace(partial, final)
        except BaseException:
            os.replace(old, final)  # the previous one stays the checkpoint of this tag
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)


# ---- load ---------------------------------------------------------------------------------------
def resolve_tag(load_dir: str, tag: str | None) -> str:
    """*tag*, or the one named in ``latest``."""
    if tag is not None:
        return check_tag(tag)
    latest = os.path.join(load_dir, LATEST)
    if not os.path.exists(latest):
        raise CheckpointError(f"no '{LATEST}' file in {load_dir}: pass tag= explicitly or "
                              f"check the directory (is it a zero-core checkpoint directory?)")
    with open(latest) as fh:
        return check_tag(fh.read().strip())


def locate(path: str, tag: str | None = None) -> tuple[str, str]:
    """``(tag directory, tag)`` for *path*: a save directory (with *tag* or ``latest``) or
    a tag directory itself (one holding ``metadata.json``)."""
    if not os.path.isdir(path):
        what = "is a file, not a directory" if os.path.exists(path) else "does not exist"
        raise CheckpointError(f"checkpoint directory {path} {what}: give the directory "
                              f"save_checkpoint wrote (it holds '{LATEST}' and one folder per "
                              f"tag), or one of its tag folders")
    if tag is None and os.path.exists(os.path.join(path, METADATA)):
        path = os.path.abspath(path)
        return path, os.path.basename(path)
    tag = resolve_tag(path, tag)
    return os.path.join(path, tag), tag


def read_metadata(load_dir: str, tag: str | None = None) -> tuple[str, dict]:
    """``(tag directory, metadata)`` of checkpoint *tag* (default: latest), validated."""
    tag_dir, tag = locate(load_dir, tag)
    path = os.path.join(tag_dir, METADATA)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint '{tag}' in {load_dir} has no {METADATA}: it is "
                              f"incomplete or not a zero-core checkpoint")
    try:
        with open(path) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc}): the checkpoint is damaged") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a JSON object: the checkpoint is damaged")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {version!r}, this zero-core reads "
                              f"version {FORMAT_VERSION}")
    for key in ("world_size", "files", "ranks"):
        if key not in meta:
            raise CheckpointError(f"{path} has no '{key}': the checkpoint is damaged")
    for name in meta["files"]:
        _check_file_name(name, path)
    return tag_dir, meta


def verify_file(tag_dir: str, name: str, meta: dict) -> str:
    """Path of file *name* after checking its presence, size and SHA-256 against *meta*."""
    _check_file_name(name, os.path.join(tag_dir, METADATA))
    path = os.path.join(tag_dir, name)
    expected = meta["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{path} is not listed in {METADATA}: the checkpoint was "
                              f"saved without it (saved by {meta['world_size']} ranks)")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        raise CheckpointError(f"{path} has {size} bytes but {expected['bytes']} were written: "
                              f"the file is truncated or was replaced")
    if _sha256_file(path) != expected["sha256"]:
        raise CheckpointError(f"{path} does not match its recorded SHA-256: the file was "
                              f"altered or corrupted")
    return path


def open_shard(tag_dir: str, name: str, meta: dict) -> SafetensorsReader:
    """A reader of shard *name*, verified against *meta* first."""
    return SafetensorsReader(verify_file(tag_dir, name, meta))


def load_plain(tag_dir: str, name: str, meta: dict):
    """Verify and load a ``torch.save`` file with ``weights_only=True`` (no code runs)."""
    path = verify_file(tag_dir, name, meta)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path} passed its checksum but cannot be loaded safely "
                              f"(weights_only): {exc}") from exc
