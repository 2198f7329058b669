"""Shared fixtures: the real SmolLM2 model is loaded once per session and shared by the engines."""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

from engine.core.host_memory import release_freed_memory

# `make test` runs two pytest-xdist workers, one a core: each computes on its share of the cores, not on all of them
# (two workers of two threads each on two cores spin against each other)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, (os.cpu_count() or 1) // WORKERS)
torch.set_num_threads(THREADS)
# The longest modules first (seconds in a two-worker run of a 2-core VM, 2026-12-04: 202, 169, 127, 113, 81, 81,
# 76, 75, 71, 69): each is one unit of work for xdist's --dist loadfile, handed out in collection order, so the long
# ones start at once and the short ones fill in behind them instead of one long module starting last
LONGEST_FIRST = ("test_parallel.py", "test_integrity.py", "test_quant_engine.py", "test_llm.py", "test_speculative.py",
                 "test_soak.py", "test_disaggregation.py", "test_deepseek.py", "test_server_guards.py", "test_cli.py")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # Triton kernels run on CPU through the interpreter

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _one_thread_count_for_every_test():
    """An engine made with num_threads sets torch's process-wide count, which outlived its test: after
    test_deepseek's one-thread engines, the FP8 fault campaign of test_integrity ran on one thread, where a
    greedy near-tie flips under another batch composition (2026-12-04: a request counted as harmed whose
    fault-free reference had itself changed with the thread count)."""
    yield
    torch.set_num_threads(THREADS)


SHARED_ENGINES: list = []       # the session's engines, open until the end by design


def open_engines() -> list:
    """Every engine this process still holds that is not closed, the session's shared ones aside."""
    from engine.llm import LLM

    return [obj for obj in gc.get_objects() if type(obj) is LLM and not getattr(obj, "closed", True)
            and not any(obj is shared for shared in SHARED_ENGINES)]


@pytest.fixture(autouse=True, scope="module")
def _engines_closed_and_memory_back_after_each_module(request):
    """No module leaves an engine open: one that something still references (a server's routes, a module fixture)
    keeps its weights and KV pool for the rest of the run (2026-12-04: four servers' engines held 1.4 GB of a
    worker to its end). Engines a module dropped are freed, but glibc keeps their pages in its heaps: handed back
    here, so one module's garbage does not raise the next one's peak."""
    yield
    release_freed_memory()
    left = open_engines()
    for llm in left:
        llm.close()
    assert not left, (f"{request.module.__name__} left {len(left)} engine(s) open: close them (with LLM(...) as "
                      f"llm, or at its fixture's teardown)")


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from engine.model.loader import BUNDLED_MODELS, bundled_gguf_path

    return bundled_gguf_path(*BUNDLED_MODELS["smollm2-135m"])


@pytest.fixture(scope="session")
def engine():
    """The default engine: SmolLM2-135M in fp32 on CPU."""
    from engine.llm import LLM

    llm = LLM(model="smollm2-135m", weights="fp32", device="cpu")
    SHARED_ENGINES.append(llm)
    return llm


@pytest.fixture(scope="session")
def english_prompts(engine) -> list[list[int]]:
    """16 prompts of different lengths cut from real English text shipped with Python."""
    from engine.core.reference_text import cut_prompts, reference_text

    lengths = [3, 7, 12, 18, 25, 31, 40, 47, 55, 64, 71, 80, 93, 101, 117, 130]
    return cut_prompts(engine.tokenizer.encode(reference_text(slice(40))), lengths, stride=150)


def run_cli(*args: str, timeout: float = 300):
    """`engine ARGS` as a process of its own: where the process is what the test is about (a run end to end, its
    workers, its exit)."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def engine_cli(*args: str):
    """`engine ARGS` through the CLI's own `main` in this process: its stdout, its stderr and its exit status, for
    tests of what the CLI prints (JSON, one-line errors) without a new interpreter importing torch (3 s each)."""
    import contextlib
    import io
    import subprocess

    from engine.cli import main

    out, err, status = io.StringIO(), io.StringIO(), 0
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    return subprocess.CompletedProcess(["engine", *args], status, out.getvalue(), err.getvalue())


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = Path(str(item.fspath)).name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)        # stable: the order within a module, and among the rest, is kept


def pytest_configure(config):
    from resources import ResourcePlugin

    config.pluginmanager.register(ResourcePlugin(config, os.environ.get("KVPLAN_TEST_RESOURCES")),
                                  "kvplan-resources")
