"""Processes as /proc (Linux) shows them: their command lines, stat fields, children, and the TCP sockets each listens
on (LISTEN state, matched by inode)."""

from __future__ import annotations

import ipaddress
import os
import time

_LISTEN = "0A"  # the state column of /proc/net/tcp


def _address(hex_address: str) -> tuple[str, int]:
    """`0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6), in the kernel's byte order, as (ip, port)."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is little-endian
    return str(ipaddress.ip_address(raw)), int(port, 16)


def listening(pid: int) -> set[tuple[str, int]]:
    """The (ip, port) pairs process `pid` listens on over TCP (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:  # no IPv6 on this machine
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                found.add(_address(fields[1]))
    return found


def wait_listening_on(pid: int, port: int, timeout_s: float = 120.0) -> set[str]:
    """The addresses `pid` listens on at `port`, once it listens there at all (AssertionError after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert stat(pid) is not None, f"process {pid} exited"
        addresses = {ip for ip, p in listening(pid) if p == port}
        if addresses:
            return addresses
        assert time.monotonic() < deadline, f"process {pid} not listening on port {port} after {timeout_s} s"
        time.sleep(0.2)


def children(pid: int) -> dict[int, str]:
    """pid → command line of the live processes whose parent is `pid`."""
    return {child: cmd.strip() for child, cmd in processes().items() if (stat(child) or [None, None])[1] == str(pid)}


def processes() -> dict[int, str]:
    """pid → command line of every live (not zombie) process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and stat(int(entry)) is not None:
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    return out


def stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, pgrp, session, ...); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields
