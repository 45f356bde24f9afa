"""The expert bank as grouped GEMMs equals the per-expert loop, and a MoE layer reads nothing on the host."""

import pytest
import torch

from d9d.mesh.testing import HostSyncCounter, run_distributed
from d9d.parallel.expert import GroupedExperts, MoE
from d9d.parallel.expert import experts as experts_module

HIDDEN, FFN, EXPERTS = 32, 48, 4


def _bank_outputs(counts: list[int], dtype: torch.dtype, *, grouped: bool, monkeypatch) -> tuple:
    if not grouped:
        monkeypatch.setattr(experts_module, "_GROUPED_MM", None)
    torch.manual_seed(0)
    bank = GroupedExperts(EXPERTS, HIDDEN, FFN).to(dtype)
    x = torch.randn(sum(counts), HIDDEN, dtype=dtype, requires_grad=True)
    out = bank(x, torch.tensor(counts))
    (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
    monkeypatch.undo()
    return out.detach(), x.grad, bank.w_gate.grad, bank.w_up.grad, bank.w_down.grad


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 7, 0], [0, 0, 0, 0]], ids=["uneven", "one", "none"])
def test_grouped_gemm_equals_the_loop_forward_and_backward(counts, monkeypatch):
    grouped = _bank_outputs(counts, torch.float32, grouped=True, monkeypatch=monkeypatch)
    loop = _bank_outputs(counts, torch.float32, grouped=False, monkeypatch=monkeypatch)
    for a, b in zip(grouped, loop, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert grouped[2][1].abs().sum() == 0 or counts[1] > 0  # an expert without tokens: zero gradient


def test_bf16_grouped_gemm_equals_the_loop_on_cpu(monkeypatch):
    grouped = _bank_outputs([5, 1, 0, 10], torch.bfloat16, grouped=True, monkeypatch=monkeypatch)
    loop = _bank_outputs([5, 1, 0, 10], torch.bfloat16, grouped=False, monkeypatch=monkeypatch)
    for a, b in zip(grouped, loop, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_which_banks_run_grouped():
    fits = experts_module.grouped_mm_fits
    assert fits(torch.zeros(1, 32), 32, 48)  # fp32: 128- and 192-byte rows
    assert not fits(torch.zeros(1, 32), 32, 6)  # a 24-byte row: the loop
    assert fits(torch.zeros(1, 8, dtype=torch.bfloat16), 8, 16)  # 16 bytes in bfloat16
    assert not fits(torch.zeros(1, 4, dtype=torch.bfloat16), 4, 16)
    assert not fits(torch.zeros(1, 32, device="meta"), 32, 48)  # neither CPU nor CUDA


def _compiled_bank_run(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Outputs and gradients of a bank eager and compiled (aot_eager: dynamo traces as inductor would,
    nothing is code-generated) over uneven routings with an empty expert, and the graph breaks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    bank = GroupedExperts(EXPERTS, HIDDEN, FFN).to(dtype)
    compiled = torch.compile(bank, backend="aot_eager")
    eager, traced = [], []
    for counts in ([3, 0, 5, 2], [1, 6, 0, 3]):
        x = torch.randn(sum(counts), HIDDEN, dtype=dtype, requires_grad=True)
        for run, into in ((bank, eager), (compiled, traced)):
            out = run(x, torch.tensor(counts))
            into += [out.detach(), *torch.autograd.grad(out.square().sum(), (x, bank.w_gate, bank.w_down))]
    return eager, traced, sum(counters["graph_break"].values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_compiled_bank_computes_what_the_eager_one_does_on_this_torch(dtype):
    # torch 2.11 cannot trace the grouped GEMM in float32: the bank runs it eagerly inside the graph
    eager, traced, _ = _compiled_bank_run(dtype)
    for a, b in zip(traced, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_compiled_bank_in_a_dtype_torch_cannot_trace_runs_its_gemms_between_two_graphs(monkeypatch):
    assert torch.bfloat16 in experts_module._TRACEABLE_DTYPES  # every torch traces bf16 (CUDA's dtype)
    monkeypatch.setattr(experts_module, "_TRACEABLE_DTYPES", frozenset())  # as float32 on torch 2.11
    eager, traced, breaks = _compiled_bank_run(torch.float32)
    for a, b in zip(traced, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert breaks > 0


def _moe_host_reads() -> list[str]:
    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, EXPERTS, 2, shared_ffn_size=16)
    x = torch.randn(4, 6, HIDDEN, requires_grad=True)
    with HostSyncCounter() as recorder:
        out = moe(x)
        (out.square().sum() + moe.last_stats.aux_loss).backward()
    return recorder.names


def test_a_moe_layer_reads_nothing_on_the_host_without_expert_parallelism():
    assert _moe_host_reads() == []


def _ep_host_reads() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from d9d.parallel.expert import parallelize_expert_parallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(HIDDEN, FFN, EXPERTS, 2))
    parallelize_expert_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep_shard",)))
    x = torch.randn(4, 6, HIDDEN, requires_grad=True)
    with HostSyncCounter() as recorder:
        model(x).square().sum().backward()
    return recorder.names


def test_with_expert_parallelism_a_layer_reads_its_split_sizes_once_2ranks():
    assert run_distributed(_ep_host_reads, 2) == [["tolist"], ["tolist"]]
