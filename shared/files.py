"""Writing a file so that readers see the old content or the new, never half of it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes | str, *, mode: int = 0o600, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    The temporary file gets ``mode`` before anything is written, so a key is
    never readable by others, not even briefly. ``fsync`` makes the content
    durable before the rename, for records a process rebuilds its state from
    after a crash.
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
