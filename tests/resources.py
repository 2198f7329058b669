"""Where the suite's time and memory go: a pytest plugin that records, per test module, its wall time, the
process's resident memory before and after it, the peak it reached (ru_maxrss, monotonic: a module that raises
it is the one that set the peak) and the peak of the processes it started and waited for.

Linux only (/proc); elsewhere it records time alone. `KVPLAN_TEST_RESOURCES=FILE` also writes the table as JSON.
Under pytest-xdist the table has every worker's modules and each worker's peak."""
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


def anonymous_rss_bytes() -> int:
    """This process's resident memory that no file backs (RssAnon): what it allocated, without the pages of files it
    maps (a GGUF reader's memmap stays mapped by design, and its pages come and go with the page cache)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    line = next((line for line in status.splitlines() if line.startswith("RssAnon:")), None)
    return int(line.split()[1]) * 1024 if line else 0


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
    worker: str = "main"
    seconds: float = 0.0
    tests: int = 0
    rss_before_mib: float = 0.0
    rss_after_mib: float = 0.0
    tree_rss_after_mib: float = 0.0
    peak_rss_mib: float = 0.0           # this process's peak so far, at the module's end
    # the largest waited-for child process so far; Linux counts a forked child's pages as of the fork, before its
    # exec, so a child that ran little shows the parent's RSS at the time (seen: `true` after 500 MB: 525 MiB)
    children_peak_rss_mib: float = 0.0


@dataclass
class ProcessPeak:
    worker: str
    wall_s: float
    peak_rss_mib: float
    children_peak_rss_mib: float


class ResourcePlugin:
    """Records per module in each process that runs tests; under pytest-xdist each worker hands its records to the
    controller (`workeroutput`), which prints one table for the run."""

    def __init__(self, config, out: str | None):
        self.config = config
        self.out = out
        self.modules: dict[str, ModuleResources] = {}
        self.peaks: list[ProcessPeak] = []
        self.started = time.perf_counter()
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        name = item.nodeid.split("::")[0]
        record = self.modules.get(name)
        if record is None:
            record = self.modules[name] = ModuleResources(name, worker=self.worker,
                                                          rss_before_mib=rss_bytes() / MIB)
        started = time.perf_counter()
        yield
        record.seconds += time.perf_counter() - started
        record.tests += 1
        if nextitem is None or nextitem.nodeid.split("::")[0] != name:
            record.rss_after_mib = rss_bytes() / MIB
            record.tree_rss_after_mib = tree_rss_bytes() / MIB
            record.peak_rss_mib = peak_rss_bytes() / MIB
            record.children_peak_rss_mib = peak_rss_bytes(resource.RUSAGE_CHILDREN) / MIB

    def own_peak(self) -> ProcessPeak:
        return ProcessPeak(self.worker, time.perf_counter() - self.started, peak_rss_bytes() / MIB,
                           peak_rss_bytes(resource.RUSAGE_CHILDREN) / MIB)

    def pytest_sessionfinish(self, session):
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:            # an xdist worker: the controller prints
            workeroutput["kvplan_resources"] = {"modules": [asdict(row) for row in self.modules.values()],
                                                "peak": asdict(self.own_peak())}

    def pytest_testnodedown(self, node, error):
        report = getattr(node, "workeroutput", {}).get("kvplan_resources")
        if report:
            self.modules.update({row["module"]: ModuleResources(**row) for row in report["modules"]})
            self.peaks.append(ProcessPeak(**report["peak"]))

    def pytest_terminal_summary(self, terminalreporter):
        if getattr(self.config, "workeroutput", None) is not None:
            return
        peaks = self.peaks or [self.own_peak()]
        rows = sorted(self.modules.values(), key=lambda row: -row.seconds)
        write = terminalreporter.write_line
        terminalreporter.section("time and memory per test module (MiB; peak = its process's so far)")
        write(f"{'module':40} {'worker':>6} {'s':>7} {'tests':>5} {'rss in':>7} {'rss out':>7} {'tree':>7} "
              f"{'peak':>7} {'child pk':>8}")
        for row in rows:
            write(f"{row.module:40} {row.worker:>6} {row.seconds:7.1f} {row.tests:5d} {row.rss_before_mib:7.0f} "
                  f"{row.rss_after_mib:7.0f} {row.tree_rss_after_mib:7.0f} {row.peak_rss_mib:7.0f} "
                  f"{row.children_peak_rss_mib:8.0f}")
        for peak in peaks:
            write(f"{peak.worker}: {peak.wall_s:.0f} s of tests, peak resident {peak.peak_rss_mib:.0f} MiB, largest "
                  f"child process {peak.children_peak_rss_mib:.0f} MiB")
        write(f"test processes at their peaks, together: {sum(p.peak_rss_mib for p in peaks):.0f} MiB; wall "
              f"{time.perf_counter() - self.started:.0f} s")
        if self.out:
            Path(self.out).write_text(json.dumps({"modules": [asdict(row) for row in rows],
                                                  "processes": [asdict(peak) for peak in peaks]}, indent=1) + "\n")
