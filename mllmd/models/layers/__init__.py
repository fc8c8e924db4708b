"""Building blocks shared by the model files (fusion.py plans which kernels they run)."""

from mllmd.models.layers.activation import SiluAndMul
from mllmd.models.layers.attention import AttentionShape, AttentionStep, RotaryAttention
from mllmd.models.layers.fusion import plan_fusions
from mllmd.models.layers.linear import Linear, MergedLinear
from mllmd.models.layers.logits import compute_logits
from mllmd.models.layers.mlp import GatedMLP
from mllmd.models.layers.norm import RMSNorm
from mllmd.models.layers.rotary import RopeTable, RotaryEmbedding, apply_rope, get_rope

__all__ = [
    "AttentionShape",
    "AttentionStep",
    "GatedMLP",
    "Linear",
    "MergedLinear",
    "RMSNorm",
    "RopeTable",
    "RotaryAttention",
    "RotaryEmbedding",
    "SiluAndMul",
    "apply_rope",
    "compute_logits",
    "get_rope",
    "plan_fusions",
]
