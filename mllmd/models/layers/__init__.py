"""Building blocks shared by the model files."""

from mllmd.models.layers.activation import SiluAndMul
from mllmd.models.layers.linear import Int8Rows, Linear, MergedLinear, NormRows, RowsWithAmax
from mllmd.models.layers.norm import RMSNorm
from mllmd.models.layers.rotary import RotaryEmbedding, get_rope

__all__ = ["Int8Rows", "Linear", "MergedLinear", "NormRows", "RMSNorm", "RowsWithAmax", "RotaryEmbedding", "SiluAndMul", "get_rope"]
