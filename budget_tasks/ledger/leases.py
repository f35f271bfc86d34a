"""Who holds a lease, and when "its process is gone" can be believed.

A lease owner names its process so that no other process anywhere can have the same
name: ``host:pid:token@boot/pidns/start``, where ``boot`` is the kernel's boot id,
``pidns`` the inode of the process's PID namespace and ``start`` the process's start
time in clock ticks since boot. Two containers may share a hostname and reuse the same
pids; they never share a PID namespace inode on one boot.

A checker believes that a lease's process is gone only when it runs on the same boot
in the same PID namespace (so the pid means the same process to both) and that pid is
absent (the kernel says so: a /proc entry this checker cannot see, under ``hidepid``
or for another user, proves nothing) or now belongs to a process that started at
another time. Anywhere else, or for an owner written without this proof, the lease
runs to its expiry.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """A process, named uniquely across hosts, containers, PID namespaces and reboots."""

    boot: str
    pidns: str
    pid: int
    start: str

    def proof(self) -> str:
        return f"{self.boot}/{self.pidns}/{self.start}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), or None if
    no such process is visible here."""
    stat = _read(_PROC / str(pid) / "stat")
    if stat is None:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its end.
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _pid_namespace() -> str | None:
    try:
        return str(os.stat(_PROC / "self" / "ns" / "pid").st_ino)
    except OSError:
        return None


_cached: tuple[int, ProcessIdentity | None] | None = None


def this_process() -> ProcessIdentity | None:
    """This process's identity, or None where the system cannot prove one (no /proc)."""
    global _cached
    pid = os.getpid()
    if _cached is not None and _cached[0] == pid:  # a forked child is another process
        return _cached[1]
    boot = _read(_PROC / "sys" / "kernel" / "random" / "boot_id")
    pidns = _pid_namespace()
    start = _start_time(pid)
    identity = None
    if boot and pidns and start:
        identity = ProcessIdentity(boot=boot, pidns=pidns, pid=pid, start=start)
    _cached = (pid, identity)
    return identity


def owner_id() -> str:
    """A lease owner for one delivery: this host and process, a token unique to the
    delivery, and (where the system gives one) the proof of which process it is."""
    name = f"{socket.gethostname()[:64]}:{os.getpid()}:{os.urandom(4).hex()}"
    identity = this_process()
    return name if identity is None else f"{name}@{identity.proof()}"


def _identity_of(owner: str) -> ProcessIdentity | None:
    name, at, proof = owner.rpartition("@")
    if not at:
        return None
    pid_text = name.split(":")[-2] if name.count(":") >= 2 else ""
    parts = proof.split("/")
    if len(parts) != 3 or not pid_text.isdigit():
        return None
    boot, pidns, start = parts
    return ProcessIdentity(boot=boot, pidns=pidns, pid=int(pid_text), start=start)


def process_is_gone(owner: str) -> bool:
    """True only when this process can prove the owner's process no longer runs: the
    same boot and PID namespace, and its pid absent or reused by another process."""
    theirs = _identity_of(owner)
    mine = this_process()
    if theirs is None or mine is None:
        return False
    if (theirs.boot, theirs.pidns) != (mine.boot, mine.pidns):
        return False  # another host, container or boot: its pids mean nothing here
    start = _start_time(theirs.pid)
    if start is not None:
        return start != theirs.start
    # Not visible in /proc: no such process, or one this checker may not see (/proc
    # mounted with hidepid, another user's). Only the kernel's "no such process" is
    # proof; a process that exists and cannot be told apart runs to its lease's expiry.
    try:
        os.kill(theirs.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def lease_is_live(owner: str | None, expires: datetime | None, now: datetime) -> bool:
    """A lease is live until it expires, unless its process is provably gone."""
    if owner is None or expires is None or expires <= now:
        return False
    return not process_is_gone(owner)
