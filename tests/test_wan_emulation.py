"""WAN emulation (ray_diloco.sync.wan_emulation): real `tc` rules on the loopback device, real TCP transfers.

Checks that a shaped port runs at the asked rate while other ports do not, that the rules are gone after the
block (also when it raises, or the process exits or gets SIGTERM inside it), that a non-root user and a delay
on a kernel without sch_netem are refused with one line. Needs root and iproute2 (`.ci/run` installs it); skips, saying
why, where either is missing.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys

import pytest

from ray_diloco.sync.wan_emulation import Link, ShapedPorts, ShapingError, netem_available, verify_link

needs_shaping = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                                   reason="WAN emulation needs root and iproute2's tc")
PORT, OTHER = 45711, 45712


def shaping_rules() -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout


@needs_shaping
def test_a_shaped_port_runs_at_the_rate_and_other_ports_do_not():
    link = Link(rate_mbit=40)
    with ShapedPorts([PORT], link):
        assert "htb 1:" in shaping_rules()
        shaped = verify_link(PORT, seconds=1.5, rate_mbit=link.rate_mbit)
        other = verify_link(OTHER, seconds=0.5, rate_mbit=1000)
    print(shaped.line(link))
    assert 0.8 <= shaped.rate_mbit / link.rate_mbit <= 1.2, shaped
    assert other.rate_mbit > 10 * link.rate_mbit, other  # Ray's own traffic is not shaped
    assert "htb" not in shaping_rules()


@needs_shaping
def test_the_rules_are_removed_when_the_block_raises_or_the_process_exits_inside_it():
    with pytest.raises(RuntimeError, match="the run failed"):
        with ShapedPorts([PORT], Link(rate_mbit=10)):
            raise RuntimeError("the run failed")
    assert "htb" not in shaping_rules()
    script = ("import sys; from ray_diloco.sync.wan_emulation import Link, ShapedPorts\n"
              f"with ShapedPorts([{PORT}], Link(rate_mbit=10)):\n    sys.exit(3)\n")
    assert subprocess.run([sys.executable, "-c", script]).returncode == 3
    assert "htb" not in shaping_rules()
    script = ("import os, signal; from ray_diloco.sync.wan_emulation import Link, ShapedPorts\n"
              f"with ShapedPorts([{PORT}], Link(rate_mbit=10)):\n    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    signal.pause()\n")
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 128 + 15  # ray job stop
    assert "htb" not in shaping_rules()


def _enter_as_nobody(conn) -> None:
    """In a forked child (the module is imported already: nobody needs to read no file): drop root, try."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    try:
        ShapedPorts([PORT], Link(rate_mbit=10)).__enter__()
        conn.send("shaped")
    except ShapingError as error:
        conn.send(f"ShapingError: {error}")


def test_without_root_shaping_is_refused_with_one_line():
    """As root: a forked child that dropped to nobody; otherwise this process's own child as it is."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_enter_as_nobody, args=(send,))
    child.start()
    child.join(timeout=30)
    answer = receive.recv() if receive.poll(1) else f"no answer (exit code {child.exitcode})"
    assert answer.startswith("ShapingError: WAN emulation needs root") and "\n" not in answer, answer
    assert shutil.which("tc") is None or "htb" not in shaping_rules()


@needs_shaping
def test_delay_is_emulated_with_netem_or_refused_where_the_kernel_has_none():
    link = Link(rate_mbit=100, delay_ms=20)
    if not netem_available():
        with pytest.raises(ShapingError, match="no sch_netem .* delay, jitter and loss cannot be emulated"):
            with ShapedPorts([PORT], link):
                pass
        assert "htb" not in shaping_rules()
        return
    with ShapedPorts([PORT], link):
        check = verify_link(PORT, seconds=1.0, rate_mbit=link.rate_mbit)
    assert 0.8 * 2 * link.delay_ms <= check.rtt_ms <= 1.5 * 2 * link.delay_ms, check


def test_bad_ports_are_refused_before_any_rule():
    with pytest.raises(ShapingError, match="fixed ports"):
        ShapedPorts([0], Link(rate_mbit=10))


def test_wan_benchmark_refuses_an_output_that_is_no_png_before_any_run(tmp_path):
    """`--output` names the plot (the JSON goes beside it); a .json there failed only after every cell had run."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "wan.py")
    done = subprocess.run([sys.executable, script, "--links", "50", "--output", str(tmp_path / "wan.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"wan.py: error: --output {tmp_path / 'wan.json'}: give a .png path "
                                                "(the JSON goes beside it)"]
    assert not list(tmp_path.iterdir())
