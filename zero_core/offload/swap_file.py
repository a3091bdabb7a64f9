"""One swap file: a header, then a flat array of one dtype, read and written by region.

Layout: ``HEADER_BYTES`` of header (magic, format version, dtype, element count, region
count), then the elements, the data padded to a multiple of ``ALIGN`` bytes. A file is
created sparse (``ftruncate``): it reads as zeros without any write, which is the initial
value of every optimizer state.

Regions are fixed at creation (``bounds``: (first element, element count) each); every
read and write covers one whole region. A CRC-32 of each region's bytes is kept (and
updated on every write); a read whose bytes do not match, or that ends early because the
file was truncated, raises :class:`OffloadError` naming the file — never returns wrong
values. The table lives in memory because swap files live only as long as the process.

I/O is positional (``os.preadv`` / ``os.pwritev``: safe from several threads at once,
and the GIL is released while the kernel copies) straight into/out of the tensors' memory.
When every region starts on an ``ALIGN``-byte boundary and the file system allows it,
transfers of aligned buffers use ``O_DIRECT`` (no page-cache copy, and the swap does not
push other processes' pages out of the cache); anything else goes through a buffered
descriptor.
"""
from __future__ import annotations

import errno
import os
import struct
import time
import zlib
from contextlib import contextmanager

import numpy as np
import torch

from zero_core.offload.errors import OffloadError, io_failure

ALIGN = 4096
HEADER_BYTES = 4096
MAGIC = b"ZCOFFLD1"
VERSION = 1
_HEADER = struct.Struct("<8sIQIQ16s")   # magic, version, numel, elem size, regions, dtype
_ZERO_CHUNK = bytes(1 << 20)
_zero_crc_cache: dict[int, int] = {}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of at least *numel* elements whose memory starts on
    an ALIGN-byte boundary and spans a multiple of ALIGN bytes (O_DIRECT's rules)."""
    elem = element_size(dtype)
    nbytes = round_up(max(numel, 1) * elem, ALIGN)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw.narrow(0, skip, nbytes).view(dtype)


def _bytes_view(t: torch.Tensor, nbytes: int) -> memoryview:
    """A writable memoryview of the first *nbytes* bytes of contiguous CPU tensor *t*."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")[:nbytes]


def zero_crc(nbytes: int) -> int:
    """CRC-32 of *nbytes* zero bytes (a fresh sparse region)."""
    if nbytes not in _zero_crc_cache:
        crc, left = 0, nbytes
        while left:
            step = min(left, len(_ZERO_CHUNK))
            crc = zlib.crc32(memoryview(_ZERO_CHUNK)[:step], crc)
            left -= step
        _zero_crc_cache[nbytes] = crc
    return _zero_crc_cache[nbytes]


def io_totals(files) -> dict:
    """Bytes moved and seconds the kernel spent moving them, summed over *files*."""
    files = list(files)
    return {"bytes_read": sum(f.bytes_read for f in files),
            "bytes_written": sum(f.bytes_written for f in files),
            "read_s": sum(f.read_s for f in files),
            "write_s": sum(f.write_s for f in files)}


@contextmanager
def waiting(store):
    """Add the seconds the block takes to ``store.wait_s``: the training thread blocked on
    the disk (both stores' reports; ci/bench/infinity.py's stalls)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        store.wait_s += time.perf_counter() - started


class SwapFile:
    """A file of *numel* elements of *dtype* at *path*, split into regions *bounds*."""

    def __init__(self, path: str, dtype: torch.dtype, numel: int,
                 bounds: list[tuple[int, int]], direct: bool = True):
        self.path, self.dtype, self.numel = path, dtype, numel
        self.elem = element_size(dtype)
        self.bounds = list(bounds)
        self.data_bytes = round_up(numel * self.elem, ALIGN)
        self.bytes_read = 0
        self.bytes_written = 0
        # seconds spent in the kernel's reads and writes (not the CRCs): with the bytes,
        # the bandwidth the disk gave this file (reports, ci/bench/infinity.py)
        self.read_s = 0.0
        self.write_s = 0.0
        self._map = None
        try:
            self._fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise io_failure(path, "creating swap file", exc) from None
        try:
            header = _HEADER.pack(MAGIC, VERSION, numel, self.elem, len(self.bounds),
                                  str(dtype).encode()[:16])
            os.pwrite(self._fd, header.ljust(HEADER_BYTES, b"\0"), 0)
            os.ftruncate(self._fd, HEADER_BYTES + self.data_bytes)
        except OSError as exc:
            self.close()
            raise io_failure(path, "creating swap file", exc, HEADER_BYTES) from None
        self.crc = [zero_crc(n * self.elem) for _, n in self.bounds]
        self._direct_fd = None
        if direct and hasattr(os, "O_DIRECT") and all(
                (lo * self.elem) % ALIGN == 0 for lo, _ in self.bounds):
            try:
                self._direct_fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError:
                self._direct_fd = None   # tmpfs and some others: buffered I/O only

    @property
    def direct(self) -> bool:
        return self._direct_fd is not None

    # ---- region I/O ---------------------------------------------------------------------
    def _plan(self, i: int, buf: torch.Tensor):
        lo, n = self.bounds[i]
        nbytes = n * self.elem
        offset = HEADER_BYTES + lo * self.elem
        if buf.dtype != self.dtype or not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError(f"swap buffers are contiguous CPU {self.dtype} tensors, got "
                             f"{buf.dtype} on {buf.device}")
        capacity = buf.numel() * self.elem
        if capacity < nbytes:
            raise ValueError(f"buffer of {buf.numel()} elements for region {i} of {n}")
        span = round_up(nbytes, ALIGN)
        if (self._direct_fd is not None and buf.data_ptr() % ALIGN == 0
                and capacity >= span):
            return self._direct_fd, offset, nbytes, span
        return self._fd, offset, nbytes, nbytes

    def read(self, i: int, buf: torch.Tensor) -> torch.Tensor:
        """Read region *i* into the start of *buf*; returns that many elements of *buf*.
        Raises OffloadError if the file is shorter than the region or its bytes changed."""
        fd, offset, nbytes, span = self._plan(i, buf)
        view = _bytes_view(buf, span)
        done = 0
        started = time.perf_counter()
        while done < span:
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and fd == self._direct_fd:
                    fd, span, view = self._fd, nbytes, view[:nbytes]
                    continue
                raise io_failure(self.path, f"reading {nbytes} bytes from", exc) from None
            if got == 0:
                break
            done += got
        self.read_s += time.perf_counter() - started
        if done < nbytes:
            raise OffloadError(
                f"offload: swap file {self.path} is truncated: region {i} needs bytes "
                f"{offset}..{offset + nbytes} but the file ends at {offset + done} (size "
                f"{self._size()}). Something outside zero-core shortened it (a cleaner, a "
                f"full disk at write time?); the offloaded state is lost: restart from a "
                f"checkpoint, and keep nvme_path for zero-core's swap files only")
        crc = zlib.crc32(view[:nbytes])
        if crc != self.crc[i]:
            raise OffloadError(
                f"offload: swap file {self.path} is corrupted: region {i} (bytes {offset}.."
                f"{offset + nbytes}) has CRC-32 {crc:#010x}, {self.crc[i]:#010x} was "
                f"written. Another process wrote into it or the disk returned bad data; "
                f"restart from a checkpoint, and check the disk")
        self.bytes_read += nbytes
        return buf.narrow(0, 0, self.bounds[i][1])

    def write(self, i: int, buf: torch.Tensor) -> None:
        """Write the first region-*i*-size elements of *buf* as region *i*."""
        fd, offset, nbytes, span = self._plan(i, buf)
        view = _bytes_view(buf, span)
        crc = zlib.crc32(view[:nbytes])
        done = 0
        started = time.perf_counter()
        while done < span:
            try:
                put = os.pwritev(fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and fd == self._direct_fd and done == 0:
                    fd, span, view = self._fd, nbytes, view[:nbytes]
                    continue
                raise io_failure(self.path, f"writing {nbytes} bytes to", exc,
                                 nbytes - done) from None
            if put <= 0:
                raise io_failure(self.path, f"writing {nbytes} bytes to",
                                 OSError(errno.ENOSPC, "no space left on device"), nbytes - done)
            done += put
            if done < span and fd == self._direct_fd:
                fd, span, view = self._fd, nbytes, view[:nbytes]  # finish unaligned tail
        self.write_s += time.perf_counter() - started
        self.crc[i] = crc
        self.bytes_written += nbytes

    def _size(self) -> int:
        try:
            return os.fstat(self._fd).st_size
        except OSError:
            return -1

    # ---- whole-array access (checkpoints) -------------------------------------------------
    def mapped(self) -> torch.Tensor:
        """The whole array as a tensor backed by a shared memory map of the file (pages
        come and go through the page cache, not this process's heap). Writes through it
        reach the file; call :meth:`reseal` before the next region read."""
        if self._map is None:
            self.check_header()
            mm = np.memmap(self.path, dtype=np.uint8, mode="r+", offset=HEADER_BYTES,
                           shape=(self.numel * self.elem,))
            data = memoryview(mm).cast("B")
            for i, (lo, n) in enumerate(self.bounds):   # hand out verified values only
                if zlib.crc32(data[lo * self.elem:(lo + n) * self.elem]) != self.crc[i]:
                    raise OffloadError(
                        f"offload: swap file {self.path} is corrupted in region {i} (CRC-32 "
                        f"mismatch); restart from a checkpoint and check the disk")
            del data
            self._map = mm
        return torch.from_numpy(self._map).view(self.dtype)

    def reseal(self) -> None:
        """After :meth:`mapped` (whose views may have been written): flush the map, recompute
        every region's CRC from it and drop it."""
        if self._map is None:
            return
        self._map.flush()
        data = memoryview(self._map).cast("B")
        for i, (lo, n) in enumerate(self.bounds):
            self.crc[i] = zlib.crc32(data[lo * self.elem:(lo + n) * self.elem])
        del data
        self._map = None

    def check_header(self) -> None:
        """Raise OffloadError if the header or the file length is not what was written."""
        try:
            head = os.pread(self._fd, _HEADER.size, 0)
        except OSError as exc:
            raise io_failure(self.path, "reading the header of", exc) from None
        want = _HEADER.pack(MAGIC, VERSION, self.numel, self.elem, len(self.bounds),
                            str(self.dtype).encode()[:16])
        if head != want:
            raise OffloadError(f"offload: swap file {self.path} has a damaged header; "
                               f"restart from a checkpoint")
        if self._size() < HEADER_BYTES + self.numel * self.elem:
            raise OffloadError(f"offload: swap file {self.path} is truncated ({self._size()} "
                               f"bytes, {HEADER_BYTES + self.numel * self.elem} needed); "
                               f"restart from a checkpoint")

    def close(self) -> None:
        """Close the descriptors (the directory removal deletes the file)."""
        self._map = None
        for name in ("_direct_fd", "_fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, None)
