"""Several "hosts" on one machine: network namespaces joined by a bridge, each with its own address.

``HostGroup.create(n)`` makes one namespace per host (``h0`` .. ``h{n-1}``, addresses 10.231.0.1 ..
10.231.0.n on a /24 that exists only inside these namespaces, loopback up) and a switch namespace
holding the bridge every host's veth cable plugs into. Nothing is added to the machine's own network
namespace, and no host has a route beyond the /24, so no packet can leave the group.

Each host also gets an ``/etc/netns/<ns>/hosts`` file naming every host and the machine's own hostname
as the host's address, as on a real cluster node. Processes start inside a host with ``Host.popen``:
in its network namespace, with that file mounted over /etc/hosts and the host's name as hostname (as
Slurm's daemons expect); the network namespace is the host, so ``Host.pids()`` (``ip netns pids``)
lists every process on it.

``HostGroup.destroy()`` kills every process in every namespace, deletes the namespaces and the hosts
files; it is idempotent and also runs at interpreter exit. Namespaces left by a test process that
was killed outright (their names carry its pid) are removed by the next ``create``.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

SUBNET = "10.231.0"  # a private /24 that exists only inside the namespaces made here
PREFIX = "miles-t"  # namespace names: miles-t<pid>-<group>-h0, miles-t<pid>-<group>-sw
ETC_NETNS = Path("/etc/netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed (exit {out.returncode}): {out.stderr.strip()}")
    return out


@dataclasses.dataclass(slots=True)
class Host:
    """One host: a network namespace with one interface (eth0) at ``addr``."""

    name: str  # h0, h1, ...: the node name in /etc/hosts and in Slurm
    netns: str
    addr: str
    switch_netns: str
    switch_port: str  # this host's cable end on the bridge

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` on this host: in its network namespace, with a UTS namespace named after the host and
        a mount namespace where its hosts file is /etc/hosts. (Not `ip netns exec`: that also mounts a
        fresh /sys without /sys/fs/cgroup, where slurmd cannot start.)"""
        setup = 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"'
        hosts_file = str(ETC_NETNS / self.netns / "hosts")
        return [
            *("nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--mount", "--uts", "--"),
            *("sh", "-c", setup, self.name, hosts_file, *argv),
        ]

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on this host, in its own session (nsenter, unshare and sh exec into it: same pid)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(argv), **kwargs)

    def pids(self) -> list[int]:
        """Every live (not zombie) process on this host."""
        out = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in out.stdout.split() if p.isdigit() and not _is_zombie(int(p))]

    def kill_all(self, sig: int = signal.SIGKILL, wait_s: float = 10.0) -> list[int]:
        """Send ``sig`` to every process on this host until none is left (SIGKILL: the node is lost)."""
        killed: list[int] = []
        deadline = time.monotonic() + wait_s
        while pids := self.pids():
            for pid in pids:
                try:
                    os.kill(pid, sig)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return sorted(set(killed))

    def set_link(self, up: bool) -> None:
        """Plug this host's cable in or pull it (both ends, as a pulled cable does)."""
        state = "up" if up else "down"
        _ip("-n", self.switch_netns, "link", "set", self.switch_port, state)
        _ip("-n", self.netns, "link", "set", "eth0", state)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class HostGroup:
    """``n`` hosts on one bridge; use as a context manager or call ``destroy()``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.switch = f"{tag}-sw"
        self.hosts: list[Host] = []
        self._destroyed = False
        atexit.register(self.destroy)

    @classmethod
    def create(cls, n: int, name: str = "g") -> HostGroup:
        """``n`` hosts; ``name`` tells apart the groups one test process holds at once."""
        remove_stale_groups()
        group = cls(f"{PREFIX}{os.getpid()}-{name}")
        try:
            group._build(n)
        except BaseException:
            group.destroy()
            raise
        return group

    def _build(self, n: int) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(n):
            host = Host(f"h{i}", f"{self.tag}-h{i}", f"{SUBNET}.{i + 1}", self.switch, f"p{i}")
            _ip("netns", "add", host.netns)
            self.hosts.append(host)
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                host.switch_port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host.netns,
            )
            _ip("-n", self.switch, "link", "set", host.switch_port, "master", "br0")
            _ip("-n", self.switch, "link", "set", host.switch_port, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        for host in self.hosts:
            self._write_hosts_file(host)

    def _write_hosts_file(self, host: Host) -> None:
        lines = ["127.0.0.1 localhost", f"{host.addr} {socket.gethostname()}"]  # the machine's name: this host
        lines += [f"{h.addr} {h.name}" for h in self.hosts]
        path = ETC_NETNS / host.netns / "hosts"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        for host in self.hosts:
            host.kill_all()
        for ns in [h.netns for h in self.hosts] + [self.switch]:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)

    def __enter__(self) -> HostGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _netns_names() -> list[str]:
    out = _ip("netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def remove_stale_groups() -> list[str]:
    """Delete the namespaces (and kill their processes) of test processes that no longer run."""
    removed = []
    for ns in _netns_names():
        if not ns.startswith(PREFIX):
            continue
        pid = ns[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or _pid_alive(int(pid))):
            continue
        for p in _ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(p), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        removed.append(ns)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def netns_problem() -> str | None:
    """None when this machine can make namespace hosts (root, `ip`, veth and bridge devices), else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the suite as root, as CI does)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) not on PATH"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make a namespace with a bridge and a veth pair here: {e}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None
