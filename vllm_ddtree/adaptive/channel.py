"""The worker -> scheduler statistics channel of ``ddtree_adaptive_budget: "online"``.
Pure Python.

A small memory-mapped file on tmpfs (the scheduler and the tensor-parallel rank 0 worker
may be different processes): a header, then running sums ``[steps, requests, sum E_n
for each candidate]`` as float64.  The scheduler creates it, the worker attaches.
Readers see values a step or so old and possibly mid-update: fine for a moving average.
(A plain file, not ``multiprocessing.shared_memory``: that one's resource tracker, shared
by vLLM's worker processes, would unlink or double-unregister the segment.)

The server may run as root on a host whose ``/dev/shm`` other users write to, so:

* the path is unguessable: ``<DIR>/vllm_ddtree_<name>_dp<rank>/stats`` with ``name``
  the random ``online_channel`` of the engine's DDTree settings (drawn once, so every
  process's copy names the same channel) and ``rank`` the data-parallel replica;
* the scheduler makes a fresh directory (``mkdir`` mode 0700, which fails on any
  existing entry, links included) and the file in it with ``O_CREAT | O_EXCL |
  O_NOFOLLOW``, mode 0600: nothing pre-created is followed, truncated or read;
* the worker opens both without following links and refuses (:class:`ChannelRefused`)
  anything but a 0700 directory and a 0600 regular file owned by its effective uid,
  whose header names its scheduler's process as creator;
* nothing stays behind: once the worker has attached (a header word), the scheduler
  removes the file and the directory (both mappings stay valid); :meth:`close` removes
  them if still there; and each creation first removes this user's channels whose
  creator process is gone (:func:`sweep_stale`: a server that was SIGKILLed).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

PREFIX = "vllm_ddtree_"
FILE = "stats"
MAGIC = int.from_bytes(b"ddtreeS1", "little")

# int64 header words, then the float64 sums
_MAGIC, _CREATOR_PID, _PID_NAMESPACE, _WIDTH, _ATTACHED = range(5)
_HEADER = struct.Struct("<5q")
_COUNTS = struct.Struct("<2d")  # steps, requests


class ChannelRefused(Exception):
    """What is at the channel's path is not this user's private channel."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where a worker finds its scheduler's channel."""

    dir_name: str  # channel_dir_name(...)
    creator_pid: int  # the scheduler's process
    parent: str | None = None  # None: StatsChannel.DIR


def channel_dir_name(name: str, data_parallel_rank: int) -> str:
    """The channel directory of replica ``data_parallel_rank`` of an engine whose config
    carries ``online_channel = name`` (replicas share one config)."""
    return f"{PREFIX}{name}_dp{data_parallel_rank}"


def _size(width: int) -> int:
    return _HEADER.size + _COUNTS.size + 8 * width


def _pid_namespace() -> int:
    """Inode of this process's pid namespace, 0 where unknown: a creator pid recorded in
    another namespace says nothing about which processes are alive here."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _private(info: os.stat_result, is_kind: Callable[[int], bool], mode: int,
             uid: int) -> str | None:
    """Why ``info`` is not a private entry of ``uid`` (None if it is)."""
    if not is_kind(info.st_mode):
        return "not a " + ("directory" if is_kind is stat.S_ISDIR else "regular file")
    if info.st_uid != uid:
        return f"owned by uid {info.st_uid}, not {uid}"
    if stat.S_IMODE(info.st_mode) != mode:
        return f"mode {stat.S_IMODE(info.st_mode):o}, not {mode:o}"
    return None


def _open_private_dir(path: str, uid: int) -> int:
    """An fd of directory ``path`` if it is ``uid``'s, mode 0700, and no link.
    FileNotFoundError if absent; :class:`ChannelRefused` otherwise."""
    try:
        reason = _private(os.lstat(path), stat.S_ISDIR, 0o700, uid)
        if reason is not None:
            raise ChannelRefused(f"{path} is {reason}")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ChannelRefused(f"{path}: {e.strerror}") from None
    reason = _private(os.fstat(fd), stat.S_ISDIR, 0o700, uid)  # the entry we opened
    if reason is not None:
        os.close(fd)
        raise ChannelRefused(f"{path} is {reason}")
    return fd


def _open_private_file(dir_fd: int, path: str, flags: int, uid: int) -> int:
    """An fd of the channel file in ``dir_fd`` if it is ``uid``'s regular 0600 file."""
    try:
        fd = os.open(FILE, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ChannelRefused(f"{path}: {e.strerror}") from None
    reason = _private(os.fstat(fd), stat.S_ISREG, 0o600, uid)
    if reason is not None:
        os.close(fd)
        raise ChannelRefused(f"{path} is {reason}")
    return fd


def _remove(path: str) -> None:
    """Remove channel directory ``path`` and its file (either may be gone already)."""
    try:
        os.unlink(os.path.join(path, FILE))
    except FileNotFoundError:
        pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def _stale_creator(path: str, uid: int, namespace: int) -> int | None:
    """The dead creator pid of channel directory ``path``, else None (alive, not a
    complete channel of ``uid``, or recorded in another pid namespace)."""
    try:
        dir_fd = _open_private_dir(path, uid)
    except (OSError, ChannelRefused):
        return None
    try:
        fd = _open_private_file(dir_fd, path, os.O_RDONLY, uid)
    except (OSError, ChannelRefused):
        return None
    finally:
        os.close(dir_fd)
    try:
        raw = os.pread(fd, _HEADER.size, 0)
    finally:
        os.close(fd)
    if len(raw) < _HEADER.size:
        return None  # being created
    header = _HEADER.unpack(raw)
    pid = header[_CREATOR_PID]
    if header[_MAGIC] != MAGIC or header[_PID_NAMESPACE] != namespace or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    except OSError:  # another user's process: alive
        return None
    return None


def sweep_stale(parent: str) -> list[str]:
    """Remove this user's channel directories under ``parent`` whose creator process is
    gone; returns their paths.  Other users' entries, links, entries of another mode,
    channels still being created and channels of another pid namespace are left."""
    uid, namespace = os.geteuid(), _pid_namespace()
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        path = os.path.join(parent, name)
        if name.startswith(PREFIX) and _stale_creator(path, uid, namespace) is not None:
            _remove(path)
            removed.append(path)
    return removed


class StatsChannel:
    """One end of the channel: :meth:`create` (scheduler) or :meth:`attach` (worker)."""

    DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    def __init__(self, mm: mmap.mmap, width: int, owned_dir: str | None):
        self.width = width
        self._mm = mm
        self._data = struct.Struct(f"<{width}d")
        # creator side: the directory to remove (None once removed, and on the worker)
        self._owned_dir = owned_dir

    @classmethod
    def create(cls, dir_name: str, width: int, parent: str | None = None) -> StatsChannel:
        """A fresh channel ``<parent>/<dir_name>`` (after :func:`sweep_stale`).  Raises
        FileExistsError if anything has that name, or another OSError."""
        parent = cls.DIR if parent is None else parent
        sweep_stale(parent)
        path = os.path.join(parent, dir_name)
        os.mkdir(path, 0o700)
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.fchmod(dir_fd, 0o700)  # whatever the umask
                fd = os.open(FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             0o600, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
            try:
                os.fchmod(fd, 0o600)
                os.ftruncate(fd, _size(width))  # zero-filled
                mm = mmap.mmap(fd, _size(width))
            finally:
                os.close(fd)
        except BaseException:
            _remove(path)
            raise
        # (magic, creator pid, pid namespace, width, attached); the magic goes in last:
        # a worker that finds none yet waits
        _HEADER.pack_into(mm, 0, 0, os.getpid(), _pid_namespace(), width, 0)
        struct.pack_into("<q", mm, 8 * _MAGIC, MAGIC)
        return cls(mm, width, path)

    @classmethod
    def attach(cls, address: ChannelAddress, width: int) -> StatsChannel:
        """The worker's end.  FileNotFoundError until the scheduler has created the
        channel; :class:`ChannelRefused` for anything that is not its private channel."""
        parent = cls.DIR if address.parent is None else address.parent
        path = os.path.join(parent, address.dir_name)
        uid = os.geteuid()
        dir_fd = _open_private_dir(path, uid)
        try:
            fd = _open_private_file(dir_fd, os.path.join(path, FILE), os.O_RDWR, uid)
        finally:
            os.close(dir_fd)
        try:
            size = os.fstat(fd).st_size
            if size == 0:  # created, not sized yet
                raise FileNotFoundError(errno.ENOENT, "channel not ready", path)
            if size != _size(width):
                raise ChannelRefused(f"{path}/{FILE} holds {size} bytes, not {_size(width)}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, creator, _, found_width, _ = _HEADER.unpack_from(mm, 0)
        problem = None
        if magic == 0:
            mm.close()
            raise FileNotFoundError(errno.ENOENT, "channel not ready", path)
        if magic != MAGIC or found_width != width:
            problem = f"{path}/{FILE} has an unknown header"
        elif creator != address.creator_pid:
            problem = (f"{path}/{FILE} was created by pid {creator}, not by the "
                       f"scheduler's process {address.creator_pid}")
        if problem is not None:
            mm.close()
            raise ChannelRefused(problem)
        struct.pack_into("<q", mm, 8 * _ATTACHED, 1)
        return cls(mm, width, None)

    def add(self, requests: int, sums: list[float]) -> None:
        """Worker: fold one publish in (the sums first, then the counts)."""
        offset = _HEADER.size + _COUNTS.size
        total = [a + b for a, b in zip(self._data.unpack_from(self._mm, offset), sums)]
        self._data.pack_into(self._mm, offset, *total)
        steps, reqs = _COUNTS.unpack_from(self._mm, _HEADER.size)
        _COUNTS.pack_into(self._mm, _HEADER.size, steps + 1, reqs + requests)

    def read(self) -> tuple[float, float, list[float]]:
        steps, reqs = _COUNTS.unpack_from(self._mm, _HEADER.size)
        return steps, reqs, list(self._data.unpack_from(self._mm, _HEADER.size + _COUNTS.size))

    @property
    def attached(self) -> bool:
        """Whether a worker has attached."""
        return struct.unpack_from("<q", self._mm, 8 * _ATTACHED)[0] != 0

    def remove_once_attached(self) -> None:
        """Scheduler: once the worker has attached, remove the file and its directory
        (the mappings stay valid), so nothing is left to clean up however the server
        ends."""
        if self._owned_dir is not None and self.attached:
            _remove(self._owned_dir)
            self._owned_dir = None

    def close(self) -> None:
        if self._owned_dir is not None:
            _remove(self._owned_dir)
            self._owned_dir = None
        self._mm.close()
