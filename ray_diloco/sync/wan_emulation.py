"""A WAN between regions on one machine: the regions' Hivemind ports get links shaped by Linux `tc`.

Real packets: every TCP segment to or from a shaped port (a region's `outer.port`, where its Hivemind node
listens; DHT and all-reduce traffic both use it) passes an HTB class on the loopback device limited to the
link's rate, one class per port and direction (a full-duplex link per region); with the kernel's `sch_netem`,
a netem qdisc under each class adds the delay, jitter and loss. Everything else on the device (Ray's own
traffic) is not classified and passes at full speed (`htb default 0`). A link belongs to a listening port, so
with two regions each direction between them is one link; with more, a region's upload is split over the
links of the ports it talks to.

Needs root and iproute2's `tc`. Kernels built without `sch_netem` (this project's CI machines, Firecracker
guests) can shape the rate but not delay, jitter or loss: asking for those there is refused with one line,
as is not being root. `verify_link` times a transfer and a ping-pong over a shaped port so a measurement
prints what the link did beside what was asked. The rules are removed on exit, also when the body raises,
on SIGTERM (in the main thread, it becomes SystemExit inside the block) and at interpreter exit; after a
SIGKILL, `remove_shaping()` (or `tc qdisc del dev lo root`) removes them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass

DEVICE = "lo"
HANDLE = "1:"  # our root qdisc's handle: the cleanup removes the root qdisc only if it is ours


class ShapingError(RuntimeError):
    """The link cannot be shaped here; the message says why and what to do."""


@dataclass(frozen=True)
class Link:
    rate_mbit: float
    delay_ms: float = 0.0  # one way; the round trip is twice this
    jitter_ms: float = 0.0
    loss_percent: float = 0.0

    @property
    def needs_netem(self) -> bool:
        return bool(self.delay_ms or self.jitter_ms or self.loss_percent)

    def label(self) -> str:
        extra = f" {2 * self.delay_ms:g} ms RTT" if self.delay_ms else ""
        extra += f" ±{self.jitter_ms:g} ms" if self.jitter_ms else ""
        extra += f" {self.loss_percent:g} % loss" if self.loss_percent else ""
        return f"{self.rate_mbit:g} Mbit/s{extra}"


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["tc", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ShapingError(f"`tc {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def netem_available() -> bool:
    """Whether this kernel has sch_netem (tried on a throwaway veth pair, removed after)."""
    probe = f"rdprobe{os.getpid() % 10000}"
    if subprocess.run(["ip", "link", "add", probe, "type", "veth", "peer", "name", probe + "p"],
                      capture_output=True).returncode != 0:
        return False
    try:
        return _tc("qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        subprocess.run(["ip", "link", "del", probe], capture_output=True)


def check_can_shape(link: Link) -> None:
    """Raise ShapingError, one line, unless this process can shape `link` here."""
    if os.geteuid() != 0:
        raise ShapingError("WAN emulation needs root (tc changes the loopback device's queueing): run as root, "
                           "or measure without --wan")
    if shutil.which("tc") is None or shutil.which("ip") is None:
        raise ShapingError("WAN emulation needs iproute2's `tc` and `ip`: apt-get install iproute2")
    if link.rate_mbit <= 0:
        raise ShapingError(f"link rate must be > 0 Mbit/s, got {link.rate_mbit}")
    if link.needs_netem and not netem_available():
        raise ShapingError(f"{link.label()}: this kernel has no sch_netem (uname -r: {os.uname().release}), so "
                           "delay, jitter and loss cannot be emulated here; shape the rate alone (delay 0)")
    shown = _tc("qdisc", "show", "dev", DEVICE).stdout
    if shown.startswith("qdisc") and "noqueue" not in shown.split("\n")[0]:
        raise ShapingError(f"{DEVICE} already has a root qdisc ({shown.splitlines()[0]}): another shaping runs, or "
                           "a killed one left it: remove it with `tc qdisc del dev lo root`")


def remove_shaping() -> None:
    """Remove our root qdisc from the loopback device (and every class and filter under it), if it is there."""
    shown = _tc("qdisc", "show", "dev", DEVICE, check=False).stdout
    if f"htb {HANDLE}" in shown.split("\n")[0]:
        _tc("qdisc", "del", "dev", DEVICE, "root", check=False)


class ShapedPorts:
    """`with ShapedPorts([port, ...], Link(...)):` traffic to and from those TCP ports is shaped inside."""

    def __init__(self, ports: list[int], link: Link):
        if not ports or any(not 0 < p < 65536 for p in ports):
            raise ShapingError(f"shaping needs fixed ports (outer.port per region), got {ports}")
        self.ports, self.link = list(ports), link

    def __enter__(self) -> "ShapedPorts":
        check_can_shape(self.link)
        atexit.register(remove_shaping)
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread():  # SIGTERM would skip atexit
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._install()
        except BaseException:
            remove_shaping()
            raise
        return self

    def __exit__(self, *exc) -> None:
        remove_shaping()
        atexit.unregister(remove_shaping)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    def _install(self) -> None:
        rate = f"{self.link.rate_mbit:g}mbit"
        # lo's MTU is 64 KiB: a burst below one packet would stall the class; a few ms of the rate smooths it.
        burst = str(max(2 * 65536 + 4096, int(self.link.rate_mbit * 1e6 / 8 / 250)))
        # Unclassified traffic goes straight through htb's direct queue: a long one, so Ray's bursts are not dropped.
        _tc("qdisc", "add", "dev", DEVICE, "root", "handle", HANDLE, "htb", "default", "0", "direct_qlen", "10000")
        minor = 10
        for port in self.ports:
            for direction in ("dport", "sport"):  # to the port and from it: one link each way
                classid = f"1:{minor}"
                _tc("class", "add", "dev", DEVICE, "parent", HANDLE, "classid", classid, "htb", "rate", rate,
                    "ceil", rate, "burst", burst, "cburst", burst, "quantum", "65536")
                if self.link.needs_netem:
                    netem = ["delay", f"{self.link.delay_ms:g}ms"]
                    netem += [f"{self.link.jitter_ms:g}ms"] if self.link.jitter_ms else []
                    netem += ["loss", f"{self.link.loss_percent:g}%"] if self.link.loss_percent else []
                    _tc("qdisc", "add", "dev", DEVICE, "parent", classid, "handle", f"{minor}:", "netem", *netem,
                        "limit", "100000")
                _tc("filter", "add", "dev", DEVICE, "protocol", "ip", "parent", HANDLE, "prio", "1", "u32",
                    "match", "ip", direction, str(port), "0xffff", "flowid", classid)
                minor += 1


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


@dataclass(frozen=True)
class LinkCheck:
    rate_mbit: float  # achieved by one TCP stream
    rtt_ms: float  # median of small ping-pongs

    def line(self, link: Link) -> str:
        return (f"link asked {link.label()}; measured {self.rate_mbit:.1f} Mbit/s, RTT {self.rtt_ms:.2f} ms "
                f"({self.rate_mbit / link.rate_mbit:.2f} of the rate)")


def verify_link(port: int, seconds: float = 1.0, rate_mbit: float = 100.0) -> LinkCheck:
    """Time a transfer of about `seconds` at `rate_mbit` and 20 ping-pongs to a server on `port` (free now)."""
    payload = max(64 * 1024, int(rate_mbit * 1e6 / 8 * seconds))
    with socket.create_server(("127.0.0.1", port)) as server:
        received: dict[str, float] = {}
        thread = threading.Thread(target=_serve, args=(server, payload, received), daemon=True)
        thread.start()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rtts = []
            for _ in range(20):
                started = time.perf_counter()
                conn.sendall(b"p")
                conn.recv(1)
                rtts.append(time.perf_counter() - started)
            conn.sendall(b"\0" * payload)
            thread.join(timeout=60 + 10 * seconds)
    if "seconds" not in received:
        raise ShapingError(f"the transfer over port {port} did not finish: the link stalls")
    return LinkCheck(received["bytes"] * 8 / received["seconds"] / 1e6, 1e3 * statistics.median(rtts))


def _serve(server: socket.socket, payload: int, received: dict[str, float]) -> None:
    conn, _ = server.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(20):
            conn.sendall(conn.recv(1))
        got, started, counted_from = 0, None, 0
        while got < payload:
            chunk = conn.recv(1 << 20)
            if not chunk:
                return
            got += len(chunk)
            if started is None and got >= payload // 8:  # past the shaper's burst: the rate it holds
                started, counted_from = time.perf_counter(), got
        received["seconds"] = time.perf_counter() - started
        received["bytes"] = got - counted_from
