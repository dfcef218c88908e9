"""Old path of :mod:`liger_lab.workbook.checks`, kept only so that old imports and notebooks still work: new
code imports ``liger_lab.workbook.checks``, and nothing in the repository imports this path."""

from liger_lab.workbook import alias

alias(__name__, "liger_lab.workbook.checks")
