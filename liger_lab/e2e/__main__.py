"""``python -m liger_lab.e2e TASK --mode MODE ...``: one measurement in this process (:func:`liger_lab.e2e.main`)."""

from liger_lab.e2e.isolation import main

main()
