"""Group commit of directory fsyncs: concurrent writers share one round of syncs.

After renaming a chunk into place a durable writer must fsync the directory.
Writers join the open batch; when no batch is being synced, one of them takes
the open batch and syncs each of its directories while new writers gather in
the next one.  A writer returns only after a sync that started after it
joined (so after its rename) finished; if that round failed, it gets the error.
"""
from __future__ import annotations

import threading
from typing import Optional, Set

from tiers.stores.nvme.chunkfile import fsync_dir


class _Batch:
    def __init__(self) -> None:
        self.dirs: Set[str] = set()
        self.done = False
        self.error: Optional[OSError] = None


class DirSyncer:
    """Makes renames durable, coalescing the fsyncs of concurrent callers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = _Batch()
        self._running: Optional[_Batch] = None
        self.syncs = 0  # directory fsyncs issued (for stats)

    def sync(self, directory: str) -> None:
        """Return once a rename into directory made before this call is durable (OSError on failure)."""
        with self._cond:
            batch = self._open
            batch.dirs.add(directory)
            while not batch.done:
                if self._running is not None:
                    self._cond.wait()
                    continue
                self._running, self._open = batch, _Batch()
                self._cond.release()
                try:
                    for path in sorted(batch.dirs):
                        fsync_dir(path)
                except OSError as exc:
                    batch.error = exc
                finally:
                    self._cond.acquire()
                    self.syncs += len(batch.dirs)
                    batch.done = True
                    self._running = None
                    self._cond.notify_all()
            if batch.error is not None:  # a fresh exception per waiter: tracebacks are per thread
                raise OSError(batch.error.errno, batch.error.strerror, batch.error.filename)
