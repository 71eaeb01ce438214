"""
Advisory file locks that name their holder: one run owns its --out_dir, one process prepares a corpus.

A lock is `fcntl.flock` on a small file. The kernel releases a flock when its holder exits in any
way, kill -9 included, so a lock never outlives its process. The holder writes a note (pid, host,
start time, command) into the file and removes the file on a clean release. A note found by the
next holder therefore means the previous one was killed; `acquire` returns that note so the caller
can say so. A busy lock either waits (corpus preparation) or raises `Locked` naming the holder
(a second run into a folder in use).

Where fcntl is missing (Windows) the lock is a no-op: a lock is a guard, not a dependency.
"""

import json
import os
import socket
import sys
import time

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


class Locked(RuntimeError):
    """The lock is held by another live process; `holder` is its note (dict, possibly empty)."""

    def __init__(self, path, holder):
        self.path, self.holder = path, holder
        super().__init__(f"{path} is held by {describe(holder)}")


def describe(note):
    """'pid 123 on host, started 2026-01-01 12:00:00: python train.py ...' from a holder's note."""
    if not note:
        return "another process"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(note.get("started", 0)))
    return f"pid {note.get('pid')} on {note.get('host')}, started {when}: {note.get('command', '?')}"


def _read_note(f):
    f.seek(0)
    text = f.read()
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:  # a holder killed while writing its note
        return {"command": "(unreadable note)"}


class FileLock:
    """Exclusive advisory lock on `path` (created if missing, removed on a clean release).

    acquire(wait) -> the note a killed holder left (dict) or None; raises Locked when not waiting
    and the lock is busy. release() removes the file and unlocks; safe to call twice. The file is
    removed while still locked, so a process that opened it before may lock a file no longer at
    `path`: acquire checks that the file it locked is still the one at `path`, and retries if not.
    Usable as a context manager (waits)."""

    def __init__(self, path):
        self.path, self._f = path, None

    def acquire(self, wait=False, on_wait=None):
        while True:
            f = open(self.path, "a+")
            if fcntl is not None:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _read_note(f) or {}
                    if not wait:
                        f.close()
                        raise Locked(self.path, holder) from None
                    if on_wait is not None:
                        on_wait(holder)
                    fcntl.flock(f, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    break
            except FileNotFoundError:   # released (and removed) while we waited: lock the next file
                pass
            f.close()
        stale = _read_note(f)
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                            "command": " ".join(sys.argv)}))
        f.flush()
        self._f = f
        return stale

    def release(self):
        f, self._f = self._f, None
        if f is None:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_UN)
        f.close()

    def __enter__(self):
        self.acquire(wait=True)
        return self

    def __exit__(self, *exc):
        self.release()
