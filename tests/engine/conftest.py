"""GPU tests here build several graphed runners in one process; production builds one and never frees its graphs."""
import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_cublas_workspaces(request):
    """Before each GPU test, with the earlier tests' graphs freed: drop torch's cached cuBLAS workspaces. torch keeps
    one per (handle, stream), and one made during a capture lives in that graph's pool; once those graphs are freed,
    a later capture on a recycled stream runs cuBLAS in freed memory (CUBLAS_STATUS_EXECUTION_FAILED,
    pytorch/pytorch#193402). Safe only while no graph is alive, hence here and not in the runner."""
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        gc.collect()
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
    yield
