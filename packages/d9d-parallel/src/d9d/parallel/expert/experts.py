"""Expert MLPs: SwiGLU, and a bank of SwiGLU experts stored as stacked weights, run as grouped GEMMs.

The bank computes all its experts in three grouped matrix multiplies (`torch.nn.functional.grouped_mm`,
torch >= 2.10; `torch._grouped_mm` before), whose group boundaries are the cumulative per-expert
token counts on the device: no host sync, and shapes that do not depend on the routing, so a
compiled block keeps one graph. The kernels need each row (hidden and ffn widths) to be a multiple
of 16 bytes and, on CUDA, bfloat16 inputs; where a bank does not fit (or torch has neither
function) it runs the per-expert loop, which reads the counts on the host once per forward. Compiled,
a bank in a dtype this torch cannot trace the grouped GEMM in (float32 on torch 2.11) runs its three
GEMMs eagerly between two graphs: a graph break, no host read, no recompile.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.parallel._torch_compat import traceable_grouped_mm_dtypes
from d9d.parallel.weight_casts import cast_weight

__all__ = ["GroupedExperts", "SwiGLU", "grouped_mm_fits"]

#: torch's grouped GEMM: public from torch 2.10, private (`torch._grouped_mm`, CUDA sm90 only) in 2.8-2.9.
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
#: The dtypes torch.compile traces `_GROUPED_MM` in; read while tracing, so found once here.
_TRACEABLE_DTYPES = traceable_grouped_mm_dtypes(_GROUPED_MM)


class SwiGLU(nn.Module):
    """The gated MLP `down(silu(gate(x)) * up(x))`; used as the shared expert."""

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, ffn_size, bias=False)
        self.up = nn.Linear(hidden_size, ffn_size, bias=False)
        self.down = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to `x` of shape [..., hidden]."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts as stacked weights: w_gate/w_up [E, hidden, ffn], w_down [E, ffn, hidden].

    Stacking makes expert parallelism a dim-0 shard of three tensors and keeps checkpoint keys
    independent of the layout. After `parallelize_expert_parallel` the weights are DTensors sharded
    on dim 0 and this module holds (and computes with) only its rank's experts.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_size = ffn_size
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform init with bound 1/sqrt(fan_in), as `nn.Linear` does for its weight."""
        for weight, fan_in in ((self.w_gate, self.hidden_size), (self.w_up, self.hidden_size)):
            nn.init.uniform_(weight, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        nn.init.uniform_(self.w_down, -1 / math.sqrt(self.ffn_size), 1 / math.sqrt(self.ffn_size))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run the local experts on `x` [N, hidden], grouped by expert: `counts[j]` rows for local expert j.

        `counts` is an integer tensor on `x`'s device (the counts are never read on the host on the
        grouped path). Groups may be empty; every expert weight still gets a (zero) gradient.

        Raises:
            RuntimeError: the counts do not add up to the rows of `x`.
        """
        # in x's dtype once per step inside `weights_cast_once` (the trainer's step), else every forward
        w_gate, w_up, w_down = (
            _local(cast_weight(w, x.dtype)) for w in (self.w_gate, self.w_up, self.w_down)
        )
        if grouped_mm_fits(x, self.hidden_size, self.ffn_size):
            offs = torch.cumsum(counts, dim=0).to(torch.int32)  # the end row of each expert's group
            # checked on the device (a CUDA device-side assert), never read on the host
            torch._assert_async(offs[-1] == x.shape[0], "expert counts must add up to the rows of x")
            if torch.compiler.is_compiling() and x.dtype not in _TRACEABLE_DTYPES:
                return _grouped_swiglu_eagerly(x, w_gate, w_up, w_down, offs)
            return _grouped_swiglu(x, w_gate, w_up, w_down, offs)
        outputs = []
        for j, x_j in enumerate(torch.split(x, counts.tolist(), dim=0)):  # the fallback's host read
            outputs.append((F.silu(x_j @ w_gate[j]) * (x_j @ w_up[j])) @ w_down[j])
        return torch.cat(outputs, dim=0)


def grouped_mm_fits(x: torch.Tensor, hidden_size: int, ffn_size: int) -> bool:
    """Whether a bank of these widths runs `x` as grouped GEMMs (else the per-expert loop).

    Needs torch's grouped GEMM, rows of 16-byte multiples (both widths), and on CUDA bfloat16
    (the kernels' only floating dtype there); CPU takes float32 and bfloat16.
    """
    if _GROUPED_MM is None or x.device.type not in ("cpu", "cuda"):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    return all(width * x.element_size() % 16 == 0 for width in (hidden_size, ffn_size))


def _grouped_swiglu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """The bank's SwiGLU as three grouped GEMMs over the groups that end at the rows `offs`."""
    assert _GROUPED_MM is not None
    gate = _contiguous_grad(_GROUPED_MM(x, w_gate, offs=offs))
    up = _contiguous_grad(_GROUPED_MM(x, w_up, offs=offs))
    return _contiguous_grad(_GROUPED_MM(F.silu(gate) * up, w_down, offs=offs))


#: `_grouped_swiglu` left out of a compiled graph, for the dtypes torch cannot trace it in.
_grouped_swiglu_eagerly = torch.compiler.disable(_grouped_swiglu)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the incoming gradient contiguous (grouped GEMM's backward
    refuses an expanded one, e.g. the gradient of a `.sum()`)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x)  # type: ignore[no-any-return]


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The rank-local part of an expert weight (the weight itself when it is not a DTensor)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight
