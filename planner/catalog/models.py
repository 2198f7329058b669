"""The model catalogue: the presets' `config.json` files, or any path to one, parsed into the shared
`engine.core.spec.ModelSpec` (the description the engine builds its modules from)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.core.errors import ConfigError
from engine.core.spec import ModelSpec, spec_from_config
from planner.errors import PlannerError
from planner.files import DATA, read_json

CONFIGS = DATA / "model-configs"
PRESETS = {
    "kimi-k2.6": "kimi-k2.6.json", "glm-5.2": "glm-5.2.json", "deepseek-v3": "deepseek-v3.json",
    "llama-3.1-8b": "llama-3.1-8b.json", "llama-3.1-70b": "llama-3.1-70b.json", "qwen3-8b": "qwen3-8b.json",
    "qwen3-14b": "qwen3-14b.json", "qwen3-32b": "qwen3-32b.json", "qwen3-30b-a3b": "qwen3-30b-a3b.json",
    "qwen3-235b-a22b": "qwen3-235b-a22b.json", "llama-4-scout": "llama-4-scout.json",
    "smollm2-135m": "smollm2-135m.json",
}


# The Hugging Face repositories the deploy commands of `planner search` name (a config path names itself)
REPOSITORIES = {
    "kimi-k2.6": "moonshotai/Kimi-K2.6", "glm-5.2": "zai-org/GLM-5.2", "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "qwen3-8b": "Qwen/Qwen3-8B", "qwen3-14b": "Qwen/Qwen3-14B", "qwen3-32b": "Qwen/Qwen3-32B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B", "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "llama-4-scout": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


def repository(name: str) -> str:
    """Where serving engines load a model from: its Hugging Face repository, or the folder of a config path."""
    return REPOSITORIES.get(name) or str(Path(name).parent if name.endswith(".json") else name)


def parse_model_config(config: dict[str, Any], name: str) -> ModelSpec:
    """`engine.core.spec.spec_from_config`, its errors as the planner's."""
    try:
        return spec_from_config(config, name)
    except ConfigError as error:
        raise PlannerError(str(error)) from None


@lru_cache(maxsize=32)
def _load_file(path: str) -> dict[str, Any]:
    return read_json(path, "config file")


def model_names() -> list[str]:
    return list(PRESETS)


def get_model(name: str) -> ModelSpec:
    """A preset by name, or a path to a `config.json`."""
    if name in PRESETS:
        return parse_model_config(_load_file(str(CONFIGS / PRESETS[name])), name)
    if name.endswith(".json") or Path(name).exists():
        return parse_model_config(_load_file(name), Path(name).stem)
    raise PlannerError(f"unknown model {name!r} (choose from {', '.join(PRESETS)}, or give a path to a config.json)")
