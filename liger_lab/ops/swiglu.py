"""The module's former name: ``liger_lab.ops.swiglu`` is :mod:`liger_lab.ops.glu` (SwiGLU and GeGLU share its
kernels), kept importable for code that imports it by that name."""

import sys

from liger_lab.ops import glu

sys.modules[__name__] = glu
