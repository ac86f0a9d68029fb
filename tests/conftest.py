import os

import pytest
import torch


def pytest_configure(config):
    # Under pytest-xdist each worker's torch would start a thread per core: with -n 8 on
    # 16 cores, 128 threads contend for the CPU references the GPU tests compute.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


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


SEED_VARIABLE = "FP4ATTN_TEST_SEED"


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Fresh random inputs every run, or the seed of FP4ATTN_TEST_SEED: a failure's report
    names the seed and the command that replays it."""
    fixed = os.environ.get(SEED_VARIABLE)
    seed = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.fp4attn_seed = seed
    yield seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = getattr(item, "fp4attn_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("replay", f"{SEED_VARIABLE}={seed} python -m pytest '{item.nodeid}'"))
    return report


@pytest.fixture(autouse=True)
def clean_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def injected_fault():
    """``FP4ATTN_TEST_FAULT=<fault>`` (attention_checks.FAULTS) runs every test with that
    fault in the reference path: the tests that still pass cannot see it."""
    fault = os.environ.get("FP4ATTN_TEST_FAULT")
    if not fault:
        yield None
        return
    from attention_checks import reference_fault

    with reference_fault(fault):
        yield fault
