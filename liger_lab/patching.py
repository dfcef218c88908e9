"""The pre-split path of :mod:`liger_lab.hf`, kept so old imports and pickles load.

A model pickled before the split names its fused classes ``liger_lab.patching.Fused...`` and its own forward
``liger_lab.patching._BoundForward``; code and notebooks name ``patching.FAMILIES``, ``patching.report``,
``patching._loss_forward``. Every name that the single module had is found here, in the module of
:mod:`liger_lab.hf` that holds it now. This old path is kept only for those pickles and old code: new code imports
:mod:`liger_lab.hf`, and nothing in the repository imports this path.
"""

from liger_lab.hf import FAMILIES, PatchReport, api, families, loss, modules, patch, registry, unpatch
from liger_lab.hf import report as report_module
from liger_lab.hf.modules import _find_fused_class
from liger_lab.hf.report import report

__all__ = ["FAMILIES", "PatchReport", "patch", "report", "unpatch"]

_HOMES = (api, report_module, loss, modules, families, registry)


def __getattr__(name: str) -> object:
    """A name of the pre-split module, from its new home: a function or table, or a fused class made on demand."""
    for home in _HOMES:
        if name in vars(home):
            return vars(home)[name]
    return _find_fused_class(name, __name__)
