"""Settings for the whole test session, loaded before any test module imports torch."""

import os

import pytest

# Inductor compiles in the process that asks, without a worker pool. The tests fork ranks from the
# pytest process and from forked children; a pool's threads in a forking parent can leave the child
# waiting on a lock no thread of its own will release (CI, cold compile cache: three forked compile
# runs waited out their 400 s). Compiling in-process costs nothing measurable on 2 cores.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _autograd_without_device_threads() -> None:
    """One backward pass before any test: autograd decides once per process, at its first backward,
    whether to start its device threads, and a process that has them can no longer fork a rank that
    runs a backward ("Unable to handle autograd's threading in combination with fork"). Deciding
    here, with the CPU alone, keeps every later fork working; a first backward after an FSDP2 unit
    on a planning mesh (`d9d plan` in this process) would start them, so the order in which a worker
    meets the test files must not decide it."""
    import torch

    torch.ones(1, requires_grad=True).sum().backward()
