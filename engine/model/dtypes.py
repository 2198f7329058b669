"""Engine dtype names to torch dtypes (the byte sizes live in engine.core.memory, which is torch-free)."""
import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
