"""``torch.nn`` modules backed by liger_lab's kernels, drop-ins for their Hugging Face counterparts.

Each keeps the parameter names, shapes and defaults of the module it replaces, so a state dict
loads either way.
"""

from liger_lab.nn.losses import (
    JSD,
    CrossEntropyLoss,
    FusedLinearCrossEntropyLoss,
    FusedLinearDPOLoss,
    FusedLinearJSD,
    FusedLinearORPOLoss,
    FusedLinearSimPOLoss,
)
from liger_lab.nn.mlp import GeGLUMLP, SwiGLUMLP
from liger_lab.nn.norms import AddRMSNorm, LayerNorm, RMSNorm

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "AddRMSNorm",
    "SwiGLUMLP",
    "GeGLUMLP",
    "CrossEntropyLoss",
    "FusedLinearCrossEntropyLoss",
    "JSD",
    "FusedLinearJSD",
    "FusedLinearDPOLoss",
    "FusedLinearORPOLoss",
    "FusedLinearSimPOLoss",
]
