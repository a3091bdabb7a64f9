"""The offload error type and the messages for disk failures."""
from __future__ import annotations

import errno

from zero_core.errors import ZeroCoreError


class OffloadError(ZeroCoreError):
    """An offload directory or swap file cannot be used (missing, unwritable, full,
    truncated, corrupted). The message names the path and what to do."""


def io_failure(path: str, action: str, exc: OSError, nbytes: int = 0) -> OffloadError:
    """An OffloadError for an OSError raised while *action* (e.g. "writing 4 MiB to") on
    *path*, with the fix for the common causes."""
    code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        fix = (f"the disk holding it is full (needed {nbytes} more bytes). Free space there, "
               f"point zero_optimization.offload_*.nvme_path at a larger disk, or offload "
               f"less (device 'cpu', fewer parameters)")
    elif code == errno.EFBIG:
        fix = ("the file grew beyond the allowed file size (ulimit -f / RLIMIT_FSIZE, or "
               "the file system's maximum); raise the limit or use another disk")
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = ("this process may not write there; choose a writable nvme_path (check "
               "permissions and that the disk is not mounted read-only)")
    elif code == errno.EIO:
        fix = "the device reported an I/O error; check the disk (dmesg) or use another one"
    else:
        fix = "check the disk and the nvme_path setting"
    return OffloadError(f"offload: {action} {path} failed: {exc.strerror or exc} "
                        f"[errno {code}]; {fix}")
