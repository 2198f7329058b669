"""One module per model family, each assembled from `engine.model.layers`; `build` picks by the spec's family."""
from __future__ import annotations

from torch import nn

from engine.core.errors import ConfigError
from engine.core.spec import ModelSpec

ENGINE_FAMILIES = ("llama", "deepseek_v3", "glm_moe_dsa")


def model_class(spec: ModelSpec) -> type[nn.Module]:
    if spec.family == "llama":
        from engine.model.architectures.llama import LlamaModel

        return LlamaModel
    if spec.family == "deepseek_v3":
        from engine.model.architectures.deepseek_v3 import DeepseekV3Model

        return DeepseekV3Model
    if spec.family == "glm_moe_dsa":
        from engine.model.architectures.glm_moe_dsa import GlmMoeDsaModel

        return GlmMoeDsaModel
    raise ConfigError(f"the engine does not run the {spec.family!r} architecture of {spec.name!r} "
                      f"(it runs {', '.join(ENGINE_FAMILIES)}; the planner plans the others)")
