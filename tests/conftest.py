"""Shared fixtures: the real SmolLM2 model is loaded once per session and shared by the engines."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

THREADS = max(1, os.cpu_count() or 1)
torch.set_num_threads(THREADS)
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


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from engine.model.loader import BUNDLED_MODELS, bundled_gguf_path

    return bundled_gguf_path(*BUNDLED_MODELS["smollm2-135m"])


@pytest.fixture(scope="session")
def engine():
    """The default engine: SmolLM2-135M in fp32 on CPU."""
    from engine.llm import LLM

    return LLM(model="smollm2-135m", weights="fp32", device="cpu")


@pytest.fixture(scope="session")
def english_prompts(engine) -> list[list[int]]:
    """16 prompts of different lengths cut from real English text shipped with Python."""
    from engine.core.reference_text import cut_prompts, reference_text

    lengths = [3, 7, 12, 18, 25, 31, 40, 47, 55, 64, 71, 80, 93, 101, 117, 130]
    return cut_prompts(engine.tokenizer.encode(reference_text(slice(40))), lengths, stride=150)


def run_cli(*args: str, timeout: float = 300):
    import subprocess

    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def pytest_configure(config):
    from resources import ResourcePlugin

    config.pluginmanager.register(ResourcePlugin(os.environ.get("KVPLAN_TEST_RESOURCES")), "kvplan-resources")
