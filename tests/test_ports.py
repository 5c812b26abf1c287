"""Ports for servers that bind later (SGLang, the weight-sync group, test jobs): outside the kernel's range for
outgoing connections, where any connection could take them first, and above Ray's worker ports."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from rlhf_mc.runtime.spawn import free_port


def test_free_ports_avoid_the_outgoing_range_and_ray_and_are_free():
    outgoing_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(20000 <= p < outgoing_low for p in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))


def test_processes_seeded_alike_do_not_pick_alike():
    """Two processes that seed the module RNG alike (as Ray workers and seeded trainers do) pick different ports:
    three picks after the same seed, twice, differ (from the seeded RNG they would be the same three)."""
    random.seed(1234)
    first = [free_port() for _ in range(3)]
    random.seed(1234)
    assert [free_port() for _ in range(3)] != first
