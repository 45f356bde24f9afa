import pytest
import torch
import torch.nn.functional as F
from _tiny_transformer import make_batches, make_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    ParallelizeError,
    UnsupportedParallelismError,
    apply_activation_checkpointing,
    parallelize_fsdp,
    parallelize_hsdp,
    parallelize_replicate,
    parallelize_tensor_parallel,
)


def _every_call_refuses_cp():
    with DistributedContext.from_env(MeshConfig(data_parallel_shard=2, context_parallel=2)) as ctx:
        dense = ctx.mesh("dense")
        calls = {
            "hsdp": lambda m: parallelize_hsdp(m, dense),
            "fsdp": lambda m: parallelize_fsdp(m, dense),
            "replicate": lambda m: parallelize_replicate(m, dense),
            "fsdp on a dp slice": lambda m: parallelize_fsdp(m, dense["dp_shard"]),
            "tensor parallel": lambda m: parallelize_tensor_parallel(m, dense, {}),
        }
        messages = {}
        for name, call in calls.items():
            model = make_model()
            with pytest.raises(
                UnsupportedParallelismError, match="context parallelism is not supported yet"
            ) as err:
                call(model)
            assert not any(isinstance(p, DTensor) for p in model.parameters())
            messages[name] = str(err.value)
        return messages


def test_context_parallel_is_refused_clearly_4_ranks():
    messages = run_distributed(_every_call_refuses_cp, 4)[0]
    assert all("context_parallel" in m for m in messages.values())


def _bad_arguments():
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = make_model()
    unchanged = parallelize_hsdp(model, mesh)  # one data-parallel rank: nothing to do
    assert unchanged is model and not any(isinstance(p, DTensor) for p in model.parameters())
    with pytest.raises(ParallelizeError, match="shard_axis 'dp'"):
        parallelize_hsdp(model, mesh, shard_axis="dp")
    with pytest.raises(ParallelizeError, match="not axes of the mesh"):
        parallelize_fsdp(model, mesh, axes=["tp"])
    with pytest.raises(ParallelizeError, match="gradient_reduction"):
        parallelize_replicate(model, mesh, gradient_reduction="avg")
    with pytest.raises(ParallelizeError, match="no axis names"):
        parallelize_fsdp(model, init_device_mesh("cpu", (1,)))
    return True


def test_size_one_mesh_is_a_no_op_and_bad_arguments_are_named_1_rank():
    assert run_distributed(_bad_arguments, 1) == [True]


def _mixed_precision():
    with DistributedContext.from_env(MeshConfig(data_parallel_shard=2)) as ctx:
        tokens = make_batches(1, 4, 8)[0]
        reference = make_model()
        ref_loss = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        model = make_model()
        parallelize_fsdp(model, ctx.mesh("dense"), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        seen = []
        model.blocks[0].attn.q.register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
        rows = tokens[2 * ctx.rank : 2 * ctx.rank + 2]
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum") / 32
        loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        grad = model.blocks[0].attn.q.weight.grad
        return (
            seen,
            logits.dtype,
            float(total),
            float(ref_loss),
            grad.dtype,
            model.blocks[0].attn.q.weight.dtype,
        )


def test_fsdp2_mixed_precision_computes_in_bf16_keeps_fp32_state():
    seen, logits_dtype, loss, ref_loss, grad_dtype, param_dtype = run_distributed(_mixed_precision, 2)[0]
    assert seen == [torch.bfloat16] and logits_dtype == torch.bfloat16
    assert grad_dtype == torch.float32 and param_dtype == torch.float32
    assert loss == pytest.approx(ref_loss, rel=2e-2)


def test_activation_checkpointing_recomputes_and_keeps_gradients_and_names():
    tokens = make_batches(1, 2, 8)[0]
    plain, checkpointed = make_model(), make_model()
    apply_activation_checkpointing(checkpointed.blocks)
    apply_activation_checkpointing(checkpointed.blocks)  # idempotent
    calls = []
    checkpointed.blocks[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    for model in (plain, checkpointed):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert len(calls) == 2  # forward, then the recomputation in backward
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
