"""``python -m liger_lab`` is the ``liger-lab`` command line."""

from liger_lab.cli import main

main()
