"""Device selection: `auto` / `cuda` / `cpu`, with CUDA faked in-process (this machine has no GPU)."""

import pytest
import torch
import torch.distributed as dist

from d9d.mesh import DistributedContext, LaunchError, MeshConfig, cuda_problem, resolve_device


@pytest.fixture
def no_gpu(monkeypatch):
    """A CUDA build of torch on a machine whose driver is missing."""

    def init():
        raise RuntimeError(
            "Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed "
            "a driver from http://www.nvidia.com/Download/index.aspx\nsecond line"
        )

    monkeypatch.setattr(torch.version, "cuda", "13.2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "init", init)


@pytest.fixture
def two_gpus(monkeypatch):
    """A node with two visible GPUs (nothing touches a real device)."""
    monkeypatch.setattr(torch.version, "cuda", "13.2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")


def test_cpu_and_auto_without_gpu_run_on_cpu(no_gpu):
    assert resolve_device("cpu", environ={}) == torch.device("cpu")
    assert resolve_device("auto", environ={}) == torch.device("cpu")
    with DistributedContext.from_env(MeshConfig(), environ={}) as ctx:
        assert ctx.device == torch.device("cpu") and ctx.device_name == "cpu"


def test_auto_survives_a_broken_device_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "device_count", broken)
    assert resolve_device("auto", environ={}) == torch.device("cpu")


def test_cuda_without_driver_is_one_clear_error(no_gpu):
    with pytest.raises(LaunchError) as info:
        resolve_device("cuda", environ={})
    message = str(info.value)
    assert "\n" not in message
    assert "the job asks for device 'cuda' but torch cannot use a GPU here: Found no NVIDIA driver" in message
    assert "set `trainer.device: cpu`" in message and "second line" not in message


def test_cuda_with_a_driver_too_old(monkeypatch, no_gpu):
    def init():
        raise RuntimeError(
            "The NVIDIA driver on your system is too old (found version 11040).\nPlease update"
        )

    monkeypatch.setattr(torch.cuda, "init", init)
    with pytest.raises(LaunchError, match=r"too old \(found version 11040\); set `trainer.device: cpu`"):
        resolve_device("cuda", environ={})


def test_cuda_with_every_gpu_hidden(two_gpus):
    assert cuda_problem({"CUDA_VISIBLE_DEVICES": ""}) == "CUDA_VISIBLE_DEVICES='' hides every GPU"
    with pytest.raises(LaunchError, match="CUDA_VISIBLE_DEVICES='' hides every GPU"):
        resolve_device("cuda", environ={"CUDA_VISIBLE_DEVICES": ""})


def test_cuda_on_a_cpu_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(LaunchError, match=r"this torch build \(.*\) has no CUDA support"):
        resolve_device("cuda", environ={})


def test_cuda_really_unusable_on_this_machine():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(LaunchError, match="torch cannot use a GPU here"):
        DistributedContext.from_env(MeshConfig(), device="cuda", environ={})


def test_unknown_device_and_conflicting_alias():
    with pytest.raises(LaunchError, match=r"device 'gpu' is not one of \['auto', 'cuda', 'cpu'\]"):
        resolve_device("gpu", environ={})
    with pytest.raises(LaunchError, match="disagree"):
        DistributedContext.from_env(MeshConfig(), device="cuda", device_type="cpu", environ={})
    with DistributedContext.from_env(MeshConfig(), device_type="cpu", environ={}) as ctx:  # the old keyword
        assert ctx.device == torch.device("cpu")


def test_each_local_rank_gets_its_gpu(two_gpus):
    assert resolve_device("cuda", local_rank=1, environ={}) == torch.device("cuda", 1)
    assert resolve_device("auto", local_rank=0, environ={}) == torch.device("cuda", 0)
    with DistributedContext.from_env(MeshConfig(), environ={}) as ctx:
        assert ctx.device == torch.device("cuda", 0)
        assert ctx.device_name == "NVIDIA H200"


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_local_rank_beyond_the_gpus_names_nproc_per_node(two_gpus, device):
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}
    with pytest.raises(LaunchError) as info:
        DistributedContext.from_env(MeshConfig(data_parallel_shard=4), device=device, environ=env)
    message = str(info.value)
    assert message.startswith("local rank 3 has no GPU: this node shows 2 GPU(s)")
    assert "`torchrun --nproc-per-node 2`" in message and "\n" not in message
    assert not dist.is_initialized()  # refused before any process group exists
