"""A userspace stand-in for `tc qdisc ... netem delay D loss L rate R` on a point-to-point link, for kernels built
without `sch_netem` (CONFIG_NET_SCH_NETEM unset, as on the 2-core CI box).

Each emulated link is a pair of TUN devices: HOST stays in the root namespace, ISLAND is moved into the island's
namespace by `tests.chaos.netns`. This process holds both file descriptors and carries every IP packet
from one to the other, per direction as netem does on an egress queue: the packet is lost with probability L
(its own seeded generator per direction), else it leaves when the link has finished sending the packets before
it (rate R: len * 8 / R seconds each) and arrives D later; at most `QUEUE_LIMIT` packets wait (netem's default
`limit`), more are dropped. Constant delay keeps the order. TCP sees real losses and a real RTT, so its
retransmissions and slow start are the kernel's own.

The devices are not persistent: they disappear when this process exits, which it does when its stdin closes
(the parent died or tore the WAN down), on SIGTERM, or on SIGINT. Counters go to `--stats` (JSON, rewritten
atomically about once a second and at exit).

    python tests/chaos/wire.py --link HOST:ISLAND [--link ...] --delay-ms 40 --loss 0.01 --rate-mbit 50 \
        --seed 0 --stats FILE

Prints `ready` on stdout once every device exists.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import heapq
import json
import os
import random
import selectors
import signal
import struct
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
QUEUE_LIMIT = 1000
"""Packets waiting per direction before more are dropped (netem's default `limit`)."""
MAX_PACKET = 65536


def open_tun(name: str) -> int:
    """A non-blocking file descriptor of a new TUN device `name` (layer 3, no packet-info header)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass(slots=True)
class Counters:
    packets: int = 0
    """Packets delivered."""
    bytes: int = 0
    lost: int = 0
    """Dropped by the loss draw."""
    overflow: int = 0
    """Dropped because QUEUE_LIMIT packets were already waiting."""


@dataclass(slots=True)
class Direction:
    """One way of one link: packets read from `src` are written to `dst`."""

    name: str
    src: int
    dst: int
    rng: random.Random
    busy_until: float = 0.0
    """When the link has finished serialising the packets already queued (rate)."""
    waiting: int = 0
    counters: Counters = field(default_factory=Counters)


@dataclass(frozen=True, slots=True)
class LinkShape:
    delay_s: float
    loss: float
    rate_bps: float


def pump(directions: list[Direction], shape: LinkShape, *, stats: Path, control: int) -> None:
    """Carry packets until `control` (stdin) reaches EOF or a signal arrives."""
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ, None)
    for d in directions:
        sel.register(d.src, selectors.EVENT_READ, d)
    due: list[tuple[float, int, Direction, bytes]] = []  # (arrival time, sequence, direction, packet)
    seq = 0
    next_stats = 0.0
    while not stop:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, d, packet = heapq.heappop(due)
            d.waiting -= 1
            try:
                os.write(d.dst, packet)
            except OSError as exc:  # the device went away (teardown) or its queue is full: a loss
                if exc.errno not in (errno.EAGAIN, errno.EIO, errno.EBADFD, errno.EINVAL):
                    raise
                d.counters.overflow += 1
                continue
            d.counters.packets += 1
            d.counters.bytes += len(packet)
        if now >= next_stats:
            write_stats(stats, directions)
            next_stats = now + 1.0
        timeout = min(1.0, max(0.0, due[0][0] - now)) if due else 1.0
        for key, _ in sel.select(timeout):
            if key.data is None:
                if not os.read(control, 4096):  # EOF: the parent is gone or tearing down
                    stop = True
                continue
            d = key.data
            while True:
                try:
                    packet = os.read(d.src, MAX_PACKET)
                except BlockingIOError:
                    break
                if d.rng.random() < shape.loss:
                    d.counters.lost += 1
                    continue
                if d.waiting >= QUEUE_LIMIT:
                    d.counters.overflow += 1
                    continue
                now = time.monotonic()
                d.busy_until = max(now, d.busy_until) + len(packet) * 8 / shape.rate_bps
                heapq.heappush(due, (d.busy_until + shape.delay_s, seq, d, packet))
                d.waiting += 1
                seq += 1
    write_stats(stats, directions)


def write_stats(path: Path, directions: list[Direction]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({d.name: asdict(d.counters) for d in directions}))
    tmp.rename(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", action="append", required=True, help="HOST:ISLAND, the two device names")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, each direction")
    parser.add_argument("--loss", type=float, required=True, help="loss probability per packet, each direction")
    parser.add_argument("--rate-mbit", type=float, required=True, help="link rate, each direction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats", type=Path, required=True)
    args = parser.parse_args(argv)
    shape = LinkShape(delay_s=args.delay_ms / 1000, loss=args.loss, rate_bps=args.rate_mbit * 1e6)
    directions: list[Direction] = []
    for i, link in enumerate(args.link):
        host_name, island_name = link.split(":")
        host, island = open_tun(host_name), open_tun(island_name)
        # one generator per direction, so the loss pattern of a link does not depend on the other's traffic
        directions.append(Direction(f"{island_name}:up", island, host, random.Random(args.seed * 1000 + 2 * i)))
        directions.append(Direction(f"{island_name}:down", host, island, random.Random(args.seed * 1000 + 2 * i + 1)))
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    pump(directions, shape, stats=args.stats, control=sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
