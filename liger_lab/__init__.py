"""liger_lab: fused Triton kernels for LLM training, and the workbook that teaches them.

``import liger_lab`` picks where kernels run (see :mod:`liger_lab.runtime`): the GPU when CUDA is
available, Triton's interpreter on CPU tensors otherwise.
"""

from liger_lab import runtime
from liger_lab.ops.rms_norm import rms_norm

__version__ = "0.1.0"

__all__ = ["__version__", "rms_norm", "runtime"]
