"""The pre-split path of :mod:`liger_lab.hf`, kept so old imports and pickles load.

A model pickled before the split names its fused classes ``liger_lab.patching.Fused...`` and its own forward
``liger_lab.patching._BoundForward``; code and notebooks name ``patching.FAMILIES``, ``patching.report``,
``patching._loss_forward``. Every name that the single module had is found here, in the module of
:mod:`liger_lab.hf` that holds it now. This old path is kept only for those pickles and old code: new code imports
:mod:`liger_lab.hf`, and nothing in the repository imports this path.
"""

from liger_lab.hf import FAMILIES, PatchReport, api, families, loss, modules, patch, registry, unpatch
from liger_lab.hf import report as report_module
from liger_lab.hf.modules import find_fused_class
from liger_lab.hf.report import report

__all__ = ["FAMILIES", "PatchReport", "patch", "report", "unpatch"]

_HOMES = (api, report_module, loss, modules, families, registry)

_RENAMED = {
    "_unwrap": "unwrap",
    "_Family": "Family",
    "_Options": "Options",
    "_causal_lm_modeling": "causal_lm_modeling",
    "_family": "family_row",
    "_modeling": "modeling_of",
    "_causal_lm": "causal_lm_class",
    "_forward_slot": "forward_slot",
    "_fused_head": "fused_head",
    "_is_class_forward": "is_class_forward",
    "_loss_forward_of": "loss_forward_of",
    "_patched_forward": "patched_forward",
    "_ROPE_FUNCTION": "ROPE_FUNCTION",
    "_experts_fallback": "experts_fallback",
    "_find_fused_class": "find_fused_class",
    "_fused_classes": "fused_classes",
    "_gated_kernel": "gated_kernel",
    "_rope_dispatcher": "rope_dispatcher",
    "_FUSED_NAMES": "FUSED_NAMES",
    "_PIECE_KINDS": "PIECE_KINDS",
    "_PieceKind": "PieceKind",
    "_UNFUSED": "UNFUSED",
    "_fused_subclass": "fused_subclass",
    "_hold": "hold",
    "_original": "original_of",
    "_release": "release",
    "_as_forward_of": "as_forward_of",
    "_is_fsdp_unit": "is_fsdp_unit",
}
"""Names of the pre-split module that are public in :mod:`liger_lab.hf` now, under the name they have there."""


def __getattr__(name: str) -> object:
    """A name of the pre-split module, from its new home: a function or table, or a fused class made on demand."""
    for home in _HOMES:
        for candidate in (name, _RENAMED.get(name)):
            if candidate in vars(home):
                return vars(home)[candidate]
    return find_fused_class(name, __name__)
