"""Where the suite's time and memory go: a pytest plugin that records, per test module, its wall time, the
process's resident memory before and after it, the peak it reached (ru_maxrss, monotonic: a module that raises
it is the one that set the peak) and the peak of the processes it started and waited for.

Linux only (/proc); elsewhere it records time alone. `KVPLAN_TEST_RESOURCES=FILE` also writes the table as JSON."""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MIB = 1 << 20


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set (0 where /proc cannot tell: gone, or not Linux)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren...), from /proc's parent links."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        parents.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def tree_rss_bytes() -> int:
    """This process's resident memory and that of every process it started that is still alive."""
    return rss_bytes() + sum(rss_bytes(child) for child in descendants(os.getpid()))


def peak_rss_bytes(who: int = resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_maxrss * 1024          # Linux reports KiB


@dataclass
class ModuleResources:
    module: str
    seconds: float = 0.0
    tests: int = 0
    rss_before_mib: float = 0.0
    rss_after_mib: float = 0.0
    tree_rss_after_mib: float = 0.0
    peak_rss_mib: float = 0.0           # this process's peak so far, at the module's end
    children_peak_rss_mib: float = 0.0  # the largest waited-for child process so far


class ResourcePlugin:
    def __init__(self, out: str | None):
        self.out = out
        self.modules: dict[str, ModuleResources] = {}
        self.started = time.perf_counter()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        name = item.nodeid.split("::")[0]
        record = self.modules.get(name)
        if record is None:
            record = self.modules[name] = ModuleResources(name, rss_before_mib=rss_bytes() / MIB)
        started = time.perf_counter()
        yield
        record.seconds += time.perf_counter() - started
        record.tests += 1
        if nextitem is None or nextitem.nodeid.split("::")[0] != name:
            record.rss_after_mib = rss_bytes() / MIB
            record.tree_rss_after_mib = tree_rss_bytes() / MIB
            record.peak_rss_mib = peak_rss_bytes() / MIB
            record.children_peak_rss_mib = peak_rss_bytes(resource.RUSAGE_CHILDREN) / MIB

    def pytest_terminal_summary(self, terminalreporter):
        rows = sorted(self.modules.values(), key=lambda row: -row.seconds)
        terminalreporter.section("time and memory per test module (MiB; peak = the process's so far)")
        terminalreporter.write_line(f"{'module':44} {'s':>7} {'tests':>5} {'rss in':>7} {'rss out':>7} "
                                    f"{'tree':>7} {'peak':>7} {'child pk':>8}")
        for row in rows:
            terminalreporter.write_line(
                f"{row.module:44} {row.seconds:7.1f} {row.tests:5d} {row.rss_before_mib:7.0f} "
                f"{row.rss_after_mib:7.0f} {row.tree_rss_after_mib:7.0f} {row.peak_rss_mib:7.0f} "
                f"{row.children_peak_rss_mib:8.0f}")
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        terminalreporter.write_line(f"wall {time.perf_counter() - self.started:.0f} s{' (' + worker + ')' if worker else ''}, "
                                    f"peak resident {peak_rss_bytes() / MIB:.0f} MiB, largest child "
                                    f"{peak_rss_bytes(resource.RUSAGE_CHILDREN) / MIB:.0f} MiB")
        if self.out:
            path = Path(self.out.replace("{worker}", worker or "main"))
            path.write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")
