"""The attention kernel a job runs (`trainer.attention.backend`): the choice, why, and what is refused.

`flash`, `cudnn`, `efficient` and `math` are torch's `scaled_dot_product_attention` (SDPA) kernels:
`AttentionKernel.sdpa()` restricts SDPA to the chosen one (`auto`: to a priority list) around a step's
forward and backward, so every SDPA call runs it: the plain causal one, context parallelism's, a
dense document mask's, and an activation-checkpointing recompute in backward. `flex` is FlexAttention
(`torch.nn.attention.flex_attention`): a module declaring an `attention_backend` attribute (the
reference model) computes its causal and document attention with it (`apply_attention_kernel`), a
Hugging Face model through transformers' `flex_attention`.

What `auto` picks, and why (torch's own preference, made explicit so the plan can say it):

- CPU: flash, torch's fused CPU kernel (SDPA's first choice there); math where it cannot.
- CUDA in bfloat16/float16: cuDNN on sm90/sm100 with cuDNN newer than 9.15 (torch ranks it first
  there), FlashAttention-2 on the other sm80+ GPUs; then efficient, then math.
- CUDA in float32 or below sm80: efficient, then math (flash and cuDNN need bf16/fp16 on sm80+).
- packed documents (a document mask) on CUDA: FlexAttention for the masked attention
  (`DocumentMask`'s own `auto`).

Refused before anything is built, each in one line (`resolve_attention`): efficient and cudnn on CPU
(torch's CPU build has only flash and math); flex on CPU (torch 2.11 to 2.15 have no FlexAttention
backward there) or on a torch without it; flex with context parallelism (its attention runs on SDPA
kernels); flash and cudnn in float32 or below sm80 on CUDA; flash with packed documents on CUDA
(flash takes no mask).
"""

import contextlib
import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from d9d.parallel.config import ATTENTION_BACKENDS, AttentionConfig
from d9d.parallel.document_attention import DocumentAttentionBackend
from d9d.parallel.errors import ParallelizeError

__all__ = [
    "AttentionConfig",
    "AttentionKernel",
    "apply_attention_kernel",
    "cuda_attention_facts",
    "resolve_attention",
]

KEY = "trainer.attention.backend"
#: The SDPA kernels, by their config name.
SDPA_KERNELS = ("flash", "cudnn", "efficient", "math")
#: cuDNN newer than this (9.15.0) is what torch needs to rank cuDNN attention first on sm90/sm100.
_CUDNN_PREFERRED_AFTER = 91500


@dataclass(frozen=True)
class AttentionKernel:
    """The attention kernel of a job, decided by `resolve_attention`.

    Attributes:
        name: the kernel the model's attention runs (flash, cudnn, efficient, math, flex), or `auto`
            when the device's capability is not known here (`d9d plan` without the GPU).
        reason: why (for `auto`), or that the config asked for it.
        order: the SDPA kernels allowed, in priority order (`sdpa()`); () for flex.
        configured: the `trainer.attention.backend` it came from.
    """

    name: str
    reason: str
    order: tuple[str, ...] = ()
    configured: str = "auto"

    def describe(self) -> str:
        """One phrase for the plan: the kernel and why."""
        return f"{self.name} ({self.reason})"

    def brief(self) -> str:
        """A short phrase for the "job built" line: the kernel and what decided it (the device,
        dtype and cuDNN for `auto`; the config), without the fallbacks `describe` lists."""
        return f"{self.name} ({self.reason.split(':')[0].split(';')[0]})"

    @property
    def model_backend(self) -> DocumentAttentionBackend:
        """What a module's own attention code uses (`apply_attention_kernel`): `flex` for flex, `sdpa` for
        an SDPA kernel asked by name (document masks too), `auto` otherwise (SDPA, and FlexAttention for
        document masks on CUDA)."""
        if self.configured == "flex":
            return "flex"
        return "sdpa" if self.configured in SDPA_KERNELS else "auto"

    def sdpa(self) -> contextlib.AbstractContextManager[None]:
        """Restrict `scaled_dot_product_attention` to `order` inside the block (torch's flags are
        process-wide, so the backward's recompute inside the block runs the same kernel)."""
        if not self.order:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH,
        }
        return sdpa_kernel([names[n] for n in self.order], set_priority=len(self.order) > 1)


def cuda_attention_facts(device: torch.device | str) -> tuple[tuple[int, int] | None, int | None]:
    """(compute capability, cuDNN version) of `device` when it is a usable CUDA device, else (None, None)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, None
    capability = torch.cuda.get_device_capability(device)
    return (int(capability[0]), int(capability[1])), torch.backends.cudnn.version()


def resolve_attention(
    config: AttentionConfig,
    device: torch.device | str,
    compute_dtype: torch.dtype,
    *,
    capability: tuple[int, int] | None = None,
    cudnn_version: int | None = None,
    document_masking: bool = False,
    context_parallel: int = 1,
) -> AttentionKernel:
    """The kernel `config` means on `device` in `compute_dtype`, or one line saying why it cannot run.

    Args:
        capability: the CUDA device's compute capability (`cuda_attention_facts`); None when unknown
            (planning without the GPU: `auto` then stays undecided, the hardware checks wait for the job).
        cudnn_version: torch's cuDNN version (e.g. 91600), for `auto` on sm90/sm100.
        document_masking: the batches carry packed documents (a document mask).
        context_parallel: the mesh's context-parallel degree.

    Raises:
        ParallelizeError: the kernel cannot run there (the message names the reason and what to use).
    """
    asked = config.backend
    if asked not in ATTENTION_BACKENDS:
        raise ParallelizeError(
            f"{KEY}: {asked!r} is not a kernel; use one of {', '.join(ATTENTION_BACKENDS)}"
        )
    device_type = torch.device(device).type
    on_cuda = device_type == "cuda"
    _refuse(asked, on_cuda, compute_dtype, capability, document_masking, context_parallel)
    if asked == "flex":
        return AttentionKernel("flex", f"asked by {KEY}; FlexAttention, compiled on CUDA", (), asked)
    if asked != "auto":
        return AttentionKernel(asked, f"asked by {KEY}; SDPA runs only this kernel", (asked,), asked)
    if not on_cuda:
        return AttentionKernel(
            "flash",
            f"auto on {device_type}: torch's fused CPU kernel; math where it cannot",
            ("flash", "math"),
        )
    return _auto_on_cuda(compute_dtype, capability, cudnn_version, document_masking)


def _auto_on_cuda(
    dtype: torch.dtype, capability: tuple[int, int] | None, cudnn_version: int | None, document_masking: bool
) -> AttentionKernel:
    """`auto` on CUDA: torch's own preference for this GPU and dtype."""
    masks = "; packed documents' mask: flex" if document_masking else ""
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype not in (torch.bfloat16, torch.float16):
        return AttentionKernel(
            "efficient", f"auto in {dtype_name}: flash and cuDNN take bf16/fp16 only; math where it cannot{masks}",
            ("efficient", "math"),
        )  # fmt: skip
    if capability is None:
        return AttentionKernel(
            "auto",
            f"decided at start from the GPU: cudnn on sm90/sm100 with cuDNN > 9.15, flash on other sm80+ "
            f"GPUs, efficient below sm80 ({dtype_name}){masks}",
            ("cudnn", "flash", "efficient", "math"),
        )
    sm = f"sm{capability[0]}{capability[1]}"
    hopper_or_blackwell = capability == (9, 0) or capability[0] == 10
    if hopper_or_blackwell and cudnn_version is not None and cudnn_version > _CUDNN_PREFERRED_AFTER:
        return AttentionKernel(
            "cudnn",
            f"auto on {sm} in {dtype_name} with cuDNN {cudnn_version}: torch's first choice there; flash, "
            f"efficient, math where it cannot{masks}",
            ("cudnn", "flash", "efficient", "math"),
        )
    if capability >= (8, 0):
        return AttentionKernel(
            "flash", f"auto on {sm} in {dtype_name}: FlashAttention-2; efficient, math where it cannot{masks}",
            ("flash", "efficient", "math"),
        )  # fmt: skip
    return AttentionKernel(
        "efficient",
        f"auto on {sm}: flash and cuDNN need sm80; math where it cannot{masks}",
        ("efficient", "math"),
    )


def _refuse(
    asked: str,
    on_cuda: bool,
    dtype: torch.dtype,
    capability: tuple[int, int] | None,
    document_masking: bool,
    context_parallel: int,
) -> None:
    """Raise the one line for a kernel that cannot run here; nothing for `auto`, which always can."""
    if asked == "flex":
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            raise ParallelizeError(
                f"{KEY}: flex, but torch {torch.__version__} has no FlexAttention "
                "(torch.nn.attention.flex_attention); use auto or an SDPA kernel (flash, cudnn, efficient, math)"
            )
        if not on_cuda:
            raise ParallelizeError(
                f"{KEY}: flex cannot train on CPU: torch {torch.__version__} has no FlexAttention backward "
                "there; use auto, flash or math on CPU (flex runs on CUDA)"
            )
        if context_parallel > 1:
            raise ParallelizeError(
                f"{KEY}: flex with mesh.context_parallel={context_parallel}: context-parallel attention runs "
                "on SDPA kernels; use auto or an SDPA kernel (flash, cudnn, efficient, math), or "
                "mesh.context_parallel: 1"
            )
        return
    if asked in ("efficient", "cudnn") and not on_cuda:
        raise ParallelizeError(
            f"{KEY}: {asked} cannot run on CPU: torch's CPU build has only the flash (fused) and math "
            "kernels; use auto, flash or math"
        )
    if asked not in ("flash", "cudnn") or not on_cuda:
        return
    if dtype not in (torch.bfloat16, torch.float16):
        raise ParallelizeError(
            f"{KEY}: {asked} takes bfloat16/float16 only on CUDA, but the compute dtype is "
            f"{str(dtype).removeprefix('torch.')}; set trainer.precision.param_dtype: bfloat16, or use "
            "efficient, math or auto"
        )
    if capability is not None and capability < (8, 0):
        raise ParallelizeError(
            f"{KEY}: {asked} needs a GPU of compute capability 8.0 (sm80) or newer, this one is "
            f"sm{capability[0]}{capability[1]}; use efficient, math or auto"
        )
    if asked == "flash" and document_masking:
        raise ParallelizeError(
            f"{KEY}: flash takes no attention mask, and packed documents (the dataset's document masking) "
            "attend through one; use efficient, cudnn, flex or auto"
        )


def apply_attention_kernel(module: nn.Module, kernel: AttentionKernel | None) -> int:
    """Tell every submodule of `module` that declares an `attention_backend` attribute which attention
    code to run (`AttentionKernel.model_backend`: "auto", "sdpa" or "flex"); returns how many.

    A module supports the choice by declaring the attribute ("auto" until set) and reading it where it
    computes attention: "flex" means FlexAttention for causal and document attention alike, "sdpa"
    SDPA for both (a dense mask for documents), "auto" SDPA with `DocumentMask`'s own choice for
    documents. SDPA's kernel itself is the step's (`AttentionKernel.sdpa`). None leaves them alone.
    """
    if kernel is None:
        return 0
    declared = [m for m in module.modules() if hasattr(m, "attention_backend")]
    for sub in declared:
        sub.attention_backend = kernel.model_backend
    return len(declared)
