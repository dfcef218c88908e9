"""Old path of :mod:`liger_lab.workbook.checks`, kept for existing imports."""

from liger_lab.workbook import alias

alias(__name__, "liger_lab.workbook.checks")
