"""Old path of :mod:`liger_lab.ops.glu` (SwiGLU and GeGLU share its kernels), kept only so that old imports still
work: new code imports ``liger_lab.ops.glu``, and nothing in the repository imports this path."""

import sys

from liger_lab.ops import glu

sys.modules[__name__] = glu
