import pytest
import torch

import liger_lab  # noqa: F401  (chooses GPU or interpreter before anything imports triton)
from liger_lab import runtime


@pytest.fixture(autouse=True)
def _fresh_seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if runtime.INTERPRET:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (bf16 and speed-sensitive checks run on the GPU)")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
