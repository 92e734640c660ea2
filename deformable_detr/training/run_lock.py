"""A run directory's one owner: `RunLock`, an exclusive `flock` on <run>/.lock that the main process
takes before it writes anything there and holds to the end of the run. A second run into the
directory stops at once, naming the process that holds it and since when (two runs writing one
directory interleave their logs and overwrite each other's checkpoints).

The kernel releases the lock when its process ends, however it ends (kill -9, a power cut), so the
file a dead run left blocks nothing: its text (pid, host, start) is only for the message. Where the
file system has no flock (some network file systems answer ENOLCK or EOPNOTSUPP), the run goes on
unlocked, saying so: refusing would stop every run there."""

import datetime
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ..errors import CommandError

LOCK_NAME = ".lock"


class RunLock:
    """`acquire()` or a CommandError naming the holder; `release()` (idempotent), or `with`."""

    def __init__(self, directory):
        self.path = Path(directory) / LOCK_NAME
        self._file = None
        self.unlocked_because = None  # the file system's answer where it has no flock

    def acquire(self) -> "RunLock":
        file = open(self.path, "a+")  # not truncated before it is ours: the holder's text stays readable
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(file)
            file.close()
            raise CommandError(
                f"{self.path.parent} is in use by another run ({holder}; the lock: {self.path}): a second "
                "run would interleave its log and overwrite its checkpoints; wait for it to end, or use another "
                "--output-dir"
            ) from None
        except OSError as error:
            file.close()
            self.unlocked_because = error.strerror or str(error)
            return self
        file.seek(0)
        file.truncate()
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}) + "\n")
        file.flush()
        self._file = file
        return self

    def release(self):
        """Closing the file releases the lock; the file stays (unlinking it would let a process that
        opened it just before lock an orphan while a third locks a new file)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exception):
        self.release()


def describe_holder(file) -> str:
    """'process 123 on host, since 2025-01-31 12:00:00 (5 min ago)' from the lock file's text."""
    file.seek(0)
    try:
        holder = json.loads(file.read())
        pid, host, started = int(holder["pid"]), str(holder["host"]), float(holder["started"])
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"
    since = datetime.datetime.fromtimestamp(started).strftime("%Y-%m-%d %H:%M:%S")
    return f"process {pid} on {host}, since {since} ({ago(time.time() - started)})"


def ago(seconds: float) -> str:
    minutes = seconds / 60
    if minutes < 1:
        return f"{max(seconds, 0):.0f} s ago"
    return f"{minutes:.0f} min ago" if minutes < 120 else f"{minutes / 60:.1f} h ago"
