"""liger_lab: fused Triton kernels for LLM training, and the workbook that teaches them.

``import liger_lab`` picks where kernels run (see :mod:`liger_lab.runtime`): the GPU when CUDA is
available, Triton's interpreter on CPU tensors otherwise.

The root exposes the library: the ops, ``patch`` for Hugging Face models and ``patch_trl`` for TRL's trainers. It
imports nothing above them (CONTRIBUTING.md lists the layers): the teaching layer is ``liger_lab.workbook``, the
tools are imported by their own names (``import liger_lab.doctor``, ``liger_lab.bench``, ``liger_lab.cli``).
"""

import warnings

from liger_lab import runtime

try:  # tells DTensor how to run the ops shard by shard (tensor and sequence parallelism)
    from liger_lab.ops import sharding  # noqa: F401
except (ImportError, AttributeError) as _error:  # DTensor internals this torch lacks: plain tensors still work
    warnings.warn(f"liger_lab: the ops will not take DTensor arguments with this torch: {_error}", stacklevel=2)
from liger_lab.hf import patch, patch_report, unpatch
from liger_lab.ops.cross_entropy import cross_entropy
from liger_lab.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from liger_lab.ops.fused_linear_jsd import fused_linear_jsd
from liger_lab.ops.glu import geglu, swiglu
from liger_lab.ops.grpo import fused_linear_grpo
from liger_lab.ops.jsd import jsd
from liger_lab.ops.layer_norm import layer_norm
from liger_lab.ops.logprobs import fused_linear_logprobs
from liger_lab.ops.mrope import mrope
from liger_lab.ops.partial_rope import partial_rope
from liger_lab.ops.preference import (
    fused_linear_cpo,
    fused_linear_dpo,
    fused_linear_kto,
    fused_linear_orpo,
    fused_linear_simpo,
)
from liger_lab.ops.rms_norm import add_rms_norm, rms_norm
from liger_lab.ops.rope import apply_rotary_pos_emb, rope
from liger_lab.trl_head import patch_trl, unpatch_trl

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "apply_rotary_pos_emb",
    "layer_norm",
    "rms_norm",
    "add_rms_norm",
    "rope",
    "mrope",
    "partial_rope",
    "runtime",
    "swiglu",
    "geglu",
    "patch",
    "patch_report",
    "unpatch",
    "patch_trl",
    "unpatch_trl",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "jsd",
    "fused_linear_jsd",
    "fused_linear_dpo",
    "fused_linear_orpo",
    "fused_linear_simpo",
    "fused_linear_kto",
    "fused_linear_cpo",
    "fused_linear_logprobs",
    "fused_linear_grpo",
]
