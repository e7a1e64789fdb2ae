import os

import pytest
import torch

# Without CUDA the Triton kernels run under triton's interpreter, which a @triton.jit function
# reads when it is defined: set before any test module imports a kernel, whatever the order in
# which test directories are collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    # GPU tests are deselected by default (addopts: -m 'not gpu'); if someone selects them on a
    # machine without CUDA they fail loudly instead of passing vacuously.
    if torch.cuda.is_available():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
