import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip, marker = pytest.mark.skip(reason="needs a CUDA GPU"), "gpu"
    elif torch.cuda.get_device_capability() != (9, 0):
        skip, marker = pytest.mark.skip(reason="the Triton kernels target sm_90 (Hopper)"), "sm90"
    else:
        return
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"seed={seed}")
    yield seed


@pytest.fixture(autouse=True)
def clean_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
