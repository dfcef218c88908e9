"""Run Hugging Face transformers models on liger_lab's kernels, without touching their weights.

:func:`patch` swaps fused versions into a transformers family (``patch("llama")``) or into one model in place
(``patch(model)``); :func:`unpatch` puts back exactly what it replaced; :func:`patch_report` says what a model runs
fused and what it leaves to transformers, and why. The files, from the bottom layer up (each imports only those
above it in this list):

* :mod:`~liger_lab.hf.registry`: the swap mechanics (every replaced attribute with the original it displaced) and
  the kinds of piece that get fused;
* :mod:`~liger_lab.hf.families`: :data:`FAMILIES`, one row per supported ``config.model_type``;
* :mod:`~liger_lab.hf.modules`: the fused norm, MLP, experts, decoder layer and attention, the RoPE dispatcher, and
  the table that builds each kind of piece;
* :mod:`~liger_lab.hf.loss`: the causal-LM forward, whose training loss does not materialise the logits, its head
  (LoRA included) and its paths through FSDP2 and accelerate;
* :mod:`~liger_lab.hf.api`: :func:`patch` and :func:`unpatch`;
* :mod:`~liger_lab.hf.report`: :func:`patch_report` (named as in ``liger_lab``: ``liger_lab.hf.report`` is the file);
* :mod:`~liger_lab.hf.hub_kernels`: liger_lab's layers for transformers' and TRL's ``use_kernels=True`` (the
  ``kernels`` package's mapping), and ``use_liger_kernel=True`` served by :func:`patch`.

A patched model pickles (``torch.save(model)``) and loads in any process: the fused classes are recorded as
``liger_lab.hf.Fused...``, found by :func:`__getattr__` (which rebuilds them), and a patched model's own ``forward``
pickles as its options. Models saved before this package existed name ``liger_lab.patching``, which still loads them.
"""

from liger_lab.hf import hub_kernels
from liger_lab.hf.api import patch, unpatch
from liger_lab.hf.families import FAMILIES
from liger_lab.hf.modules import find_fused_class
from liger_lab.hf.report import PatchReport
from liger_lab.hf.report import report as patch_report

__all__ = ["FAMILIES", "PatchReport", "hub_kernels", "patch", "patch_report", "unpatch"]


def __getattr__(name: str) -> type:
    """The fused classes by name (``FusedLlamaRMSNorm``, ...), made on demand: pickle looks up the class of a
    patched module here, also in a process that has patched nothing yet."""
    return find_fused_class(name, __name__)
