"""Tensor parallelism of a transformers model from its config's `base_model_tp_plan`.

transformers declares, per architecture, how its decoder layers split over tp ranks as plan strings
(`config.base_model_tp_plan`, e.g. `{"layers.*.self_attn.q_proj": "colwise", ...}`). d9d applies
those strings with torch's DTensor styles (`d9d.parallel.parallelize_tensor_parallel`), only the
ones whose result is the one process's (`STYLES`):

    colwise                         Linear weight split by output rows; the output stays split
                                    (local heads, local MLP columns)
    rowwise                         Linear weight split by input columns on a split input; the
                                    partial outputs are summed (all-reduce)
    colwise_gather_output / _rep    column split, the output gathered whole
    rowwise_split_input / _rep      row split on a whole input (each rank takes its slice)
    replicated_with_grad_allreduce  a per-head norm between the two: weights replicated, their
                                    gradients summed over the ranks' heads

Every other module with parameters (embedding, norms, LM head) is replicated over tp as a DTensor
(`d9d.parallel.ReplicateParallel`): each rank computes it whole, so every parameter of the model is
a DTensor (foreach optimizers, checkpoints and the grad norm read placements). The vocabulary is
not split: the logits come out whole. Attention then runs on each rank's heads, which needs the
architecture's attention to read the local head count from its tensors (`view(..., -1, head_dim)`);
that is checked per architecture by a test, so only `TENSOR_PARALLEL_ARCHITECTURES` are offered.
"""

from collections.abc import Callable, Mapping

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers import PretrainedConfig

from d9d.mesh import DistributedContext
from d9d.parallel import ReplicateParallel, TensorParallelPlan, parallelize_tensor_parallel
from d9d.trainer.build.materialize import shared_parameters
from d9d.trainer.hf.errors import HFModelError

__all__ = [
    "STYLES",
    "TENSOR_PARALLEL_ARCHITECTURES",
    "apply_tensor_parallel",
    "tensor_parallel_plan",
    "tensor_parallel_problem",
]

#: transformers' plan style → the torch style that computes it exactly (the same numbers as one process).
STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    # q_norm / k_norm on [..., local heads, head_dim]: each rank normalizes its own heads (dim -2)
    "replicated_with_grad_allreduce": lambda: ReplicateParallel(input_layouts=Shard(-2)),
}
#: The architectures (config.json's model_type) whose tensor-parallel training is tested equal to one
#: process (tests/hf/test_hf_tensor_parallel.py): their attention reshapes by the local head count.
#: Not gemma2, gemma3_text nor olmo2: their TP 2 training losses equal one process, but their logits
#: in eval mode differed by 2% (measured, transformers 5.24), so they are refused as not verified
#: until that is understood.
TENSOR_PARALLEL_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3"})
#: Column-wise projections whose output holds attention heads: splitting them splits the heads.
_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj")
#: Which weight dim each splitting style cuts (weight [out, in]; a bias follows dim 0 or stays whole).
_SPLIT_DIM = {
    "colwise": 0,
    "colwise_gather_output": 0,
    "colwise_rep": 0,
    "rowwise": 1,
    "rowwise_split_input": 1,
    "rowwise_rep": 1,
}


def tensor_parallel_problem(
    config: PretrainedConfig,
    tp: int,
    *,
    prefix: str,
    shapes: Mapping[str, tuple[int, ...]],
) -> str | None:
    """Why `config`'s model cannot be trained exactly at `mesh.tensor_parallel=tp`, or None (pure).

    Args:
        prefix: the base model's module path in the causal LM (`base_model_prefix`, e.g. "model"),
            which the plan's names are relative to.
        shapes: the folder's tensor shapes (from the safetensors headers), whose split dims must
            divide by tp.
    """
    if tp == 1:
        return None
    model_type = str(config.model_type)
    plan = config.base_model_tp_plan
    if not plan:
        return f"model_type {model_type!r} has no tensor-parallel plan in transformers (base_model_tp_plan)"
    unsupported = sorted({style for style in plan.values() if style not in STYLES})
    if unsupported:
        where = next(key for key, style in plan.items() if style == unsupported[0])
        return (
            f"model_type {model_type!r}'s base_model_tp_plan uses {', '.join(map(repr, unsupported))} "
            f"(e.g. {where}), which d9d does not apply exactly yet (it applies {', '.join(STYLES)})"
        )
    if model_type not in TENSOR_PARALLEL_ARCHITECTURES:
        return (
            f"tensor parallelism of model_type {model_type!r} is not verified yet (tested equal to one "
            f"process: {', '.join(sorted(TENSOR_PARALLEL_ARCHITECTURES))})"
        )
    text = config.get_text_config()
    if any(style == "colwise" and key.rsplit(".", 1)[-1] in _HEAD_PROJECTIONS for key, style in plan.items()):
        heads = getattr(text, "num_attention_heads", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if isinstance(value, int) and value % tp:
                return (
                    f"config.json's {key}={value} is not divisible by mesh.tensor_parallel={tp} (tensor "
                    "parallelism splits the attention heads)"
                )
    patterns = [
        (_pattern(_join(prefix, key)), _SPLIT_DIM[style])
        for key, style in plan.items()
        if style in _SPLIT_DIM
    ]
    for name, shape in shapes.items():
        module, _, tensor = name.rpartition(".")
        for pattern, dim in patterns:
            if tensor == "weight" and len(shape) == 2 and _matches(pattern, module) and shape[dim] % tp:
                return (
                    f"{name} has {shape[dim]} {'rows' if dim == 0 else 'columns'}, not divisible by "
                    f"mesh.tensor_parallel={tp} (its plan style splits them)"
                )
    return None


def tensor_parallel_plan(model: nn.Module, config: PretrainedConfig, prefix: str) -> TensorParallelPlan:
    """`config.base_model_tp_plan` as torch styles, its names under `prefix` (paths in `model`).

    Only patterns that name a module of `model` are kept (torch warns for the others).
    """
    plan: TensorParallelPlan = {}
    paths = [path for path, _ in model.named_modules()]
    for key, style in (config.base_model_tp_plan or {}).items():
        name = _join(prefix, key)
        pattern = _pattern(name)
        if any(_matches(pattern, path) for path in paths):
            plan[name] = STYLES[style]()
    return plan


def apply_tensor_parallel(
    model: nn.Module, config: PretrainedConfig, prefix: str, context: DistributedContext
) -> None:
    """Split `model` over the mesh's tp axis by its config's plan and replicate every other parameter
    over tp (a no-op when tp is 1). Call it on the meta device, before LoRA and FSDP.

    Tied parameters (an LM head sharing the embedding's table) stay one parameter.
    """
    if context.axis_size("tp") == 1:
        return
    mesh = context.mesh("dense")
    ties = shared_parameters(model)  # DTensor styles replace parameters: re-tie them after
    plan = tensor_parallel_plan(model, config, prefix)
    if not plan:  # nothing would be split: every rank would compute the whole model
        raise HFModelError(
            f"mesh.tensor_parallel: the base_model_tp_plan of model_type {config.model_type!r} names no module of the model under "
            f"{prefix or 'its root'!r}; set mesh.tensor_parallel: 1"
        )
    parallelize_tensor_parallel(model, mesh, plan)
    replicated: TensorParallelPlan = {
        path: ReplicateParallel()
        for path, module in model.named_modules()
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False))
    }
    parallelize_tensor_parallel(model, mesh, replicated)
    for (module, name), (owner, owner_name) in ties.items():
        module._parameters[name] = owner._parameters[owner_name]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _pattern(name: str) -> list[str]:
    return name.split(".")


def _matches(pattern: list[str], path: str) -> bool:
    """Whether module `path` matches a plan name (`*` stands for one name level, as in torch's plans)."""
    atoms = path.split(".")
    return len(atoms) == len(pattern) and all(p in ("*", a) for p, a in zip(pattern, atoms, strict=True))
