"""The project as a user gets it: a wheel that works outside the checkout, and rooms that import only downward."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _run(command: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    """Built as `pip wheel .` builds it and installed (not editable) into a fresh environment that sees this one's
    dependencies but not its editable kvplan: every room, the catalogues and the committed profiles come along."""
    source = tmp_path / "source"          # a copy: the build's own folders stay out of the checkout
    for room in ("engine", "planner"):
        shutil.copytree(REPO / room, source / room, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source)
    built = _run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                  "-w", str(tmp_path / "dist")], cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("kvplan-*.whl"))

    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).stdout.strip())
    # a plain path line: the dependencies' folder joins sys.path, its .pth files (the editable finder) do not run
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(wheel)],
                     cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-2000:]

    where = _run([str(python), "-c", "import engine.core.spec, planner.ui.plots, engine.model.architectures.llama;"
                  "print(engine.__file__, planner.__file__)"], cwd=tmp_path)
    assert where.returncode == 0, where.stderr[-2000:]
    assert all(path.startswith(str(site)) for path in where.stdout.split()), where.stdout

    plan = _run([str(env / "bin" / "planner"), "plan", "--model", "kimi-k2.6", "--hardware", "h200", "--gpus", "8",
                 "--json"], cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-2000:]
    document = json.loads(plan.stdout)
    assert document["kv_capacity_tokens"] > 0
    assert document["uncertainty_pct"]["decode_tokens_per_s"] > 0     # the committed calibration came along

    info = _run([str(env / "bin" / "engine"), "info", "--model", "smollm2-135m", "--json"], cwd=tmp_path)
    assert info.returncode == 0, info.stderr[-2000:]
    assert json.loads(info.stdout)["weight_bytes"] > 100_000_000


def test_an_upward_import_breaks_the_layer_contracts(tmp_path):
    """A copy of the code in which the torch-free core imports the server: `lint-imports` refuses it, naming both."""
    for room in ("engine", "planner"):
        shutil.copytree(REPO / room, tmp_path / room, ignore=shutil.ignore_patterns("__pycache__", "data", "profiles"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    lint = [str(BIN / "lint-imports"), "--config", str(tmp_path / "pyproject.toml"), "--no-cache"]
    environment = {"PYTHONPATH": str(tmp_path), "PATH": str(BIN)}

    clean = subprocess.run(lint, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=environment)
    assert clean.returncode == 0, clean.stdout[-3000:]

    errors = tmp_path / "engine" / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\nfrom engine.server import app  # noqa: E402\n")
    broken = subprocess.run(lint, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=environment)
    assert broken.returncode != 0
    assert "engine rooms import only downward BROKEN" in broken.stdout
    assert "engine.core.errors -> engine.server.app" in broken.stdout
