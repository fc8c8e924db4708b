"""compressed-tensors W8A8 (int8) and W4A16 (int4) checkpoints: config parsing, quantized Linear
storage (`methods`), per-device GEMM kernels (`kernels`) and their torch references (`ops`); importing
the package registers the Triton kernels for CUDA (`triton_kernels`) ahead of the references, and the
CUDA W4A16 decode kernel (`cuda_kernels`, where nvcc builds it) ahead of those."""

from mllmd.models.quantization.config import (
    W4A16,
    W8A8,
    LinearScheme,
    QuantConfig,
    UnsupportedQuantization,
    parse_quant_config,
)
from mllmd.models.quantization.cuda_kernels import CudaW4A16Kernel  # imports triton_kernels first: preferred
from mllmd.models.quantization.kernels import QuantLinearKernel, register_kernel, select_kernel
from mllmd.models.quantization.methods import QuantMethod, create_quant_method
from mllmd.models.quantization.triton_kernels import TritonW4A16Kernel, TritonW8A8Kernel

__all__ = [
    "CudaW4A16Kernel",
    "W4A16",
    "W8A8",
    "LinearScheme",
    "QuantConfig",
    "QuantLinearKernel",
    "QuantMethod",
    "TritonW4A16Kernel",
    "TritonW8A8Kernel",
    "UnsupportedQuantization",
    "create_quant_method",
    "get_linear_scheme",
    "parse_quant_config",
    "register_kernel",
    "select_kernel",
]


def get_linear_scheme(quant_config: QuantConfig | None, *names: str) -> LinearScheme | None:
    """Scheme of the linear layer made of checkpoint modules `names` (None: full precision)."""
    return None if quant_config is None else quant_config.scheme_for(names)
