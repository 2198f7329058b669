"""Who may touch the engine's parts: every module outside the engine's executor goes through the `LLM` facade;
only the tools that measure or corrupt the parts on purpose reach them as `LLM.core`."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# white-box tools: what they do is measure or corrupt the engine's parts
CORE_USERS = {
    "engine/harness/profiler.py",           # seeds synthetic batches, times layers and collectives
    "engine/harness/fingerprint.py",        # weight bytes and dtypes of the loaded model
    "engine/harness/fault_campaign.py",     # corrupts tables, records, pages and scales
    "bench/integrity.py",                   # times the checker's own work inside a step
    "bench/moe.py",                         # the routers' statistics inside a step
    "bench/quant.py",                       # re-quantizes the loaded weights with a search
}
FACADE_ONLY = ["engine/server", "engine/harness", "engine/cli.py", "planner", "bench", "scripts", "app.py"]
INTERNALS = {"block_manager", "scheduler", "runner", "executor", "kv_cache", "integrity", "workers", "ranks",
             "proposer", "last_output", "worker"}


def facade_users() -> list[Path]:
    files = []
    for entry in FACADE_ONLY:
        path = ROOT / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def reach_ins(path: Path, root: Path = ROOT) -> list[str]:
    """`x.core` anywhere (but `engine.core`), and `llm.<internal>` on a name ending in `llm`."""
    tree = ast.parse(path.read_text())
    modules = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        if node.attr == "core" and name not in modules:
            found.append(f"{path.relative_to(root)}:{node.lineno}: .core")
        elif node.attr in INTERNALS and name.endswith("llm"):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {name}.{node.attr}")
    return found


def test_only_the_white_box_tools_reach_past_the_facade():
    users = facade_users()
    assert len(users) > 50 and all(path.exists() for path in users)
    outside = [hit for path in users if str(path.relative_to(ROOT)) not in CORE_USERS for hit in reach_ins(path)]
    assert outside == []
    assert all(reach_ins(ROOT / tool) for tool in CORE_USERS)        # each listed tool does need the core


def test_the_checker_sees_a_reach_in(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import engine\n\n\ndef f(llm):\n    llm.core.scheduler\n    self.llm.block_manager\n"
                      "    engine.core\n")
    assert sorted(hit.split(": ")[1] for hit in reach_ins(sample, tmp_path)) == [".core", "llm.block_manager"]


def test_the_facade_is_thin():
    assert len((ROOT / "engine/llm.py").read_text().splitlines()) < 200
