"""`resolve_attention`: what `auto` picks on each device and why, each refusal in one line, and that the
kernel asked is the one SDPA runs (counted with the profiler, forward and backward)."""

import collections
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from d9d.parallel import AttentionConfig, ParallelizeError, apply_attention_kernel, resolve_attention

BF16, FP32 = torch.bfloat16, torch.float32
#: What each SDPA kernel runs on CPU, as the profiler names the ops.
CPU_OPS = {
    "flash": ("aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "math": ("aten::_scaled_dot_product_attention_math",),
}  # fmt: skip


def _resolve(backend: str, device: str = "cpu", dtype: torch.dtype = FP32, **kw):
    return resolve_attention(AttentionConfig(backend=backend), device, dtype, **kw)


@pytest.mark.parametrize(
    ("device", "dtype", "facts", "name", "order"),
    [
        ("cpu", FP32, {}, "flash", ("flash", "math")),
        ("cpu", BF16, {}, "flash", ("flash", "math")),
        ("cuda", BF16, {"capability": (9, 0), "cudnn_version": 91600}, "cudnn", ("cudnn", "flash", "efficient", "math")),
        ("cuda", BF16, {"capability": (10, 0), "cudnn_version": 91600}, "cudnn", ("cudnn", "flash", "efficient", "math")),
        ("cuda", BF16, {"capability": (9, 0), "cudnn_version": 91500}, "flash", ("flash", "efficient", "math")),
        ("cuda", BF16, {"capability": (8, 0), "cudnn_version": 91600}, "flash", ("flash", "efficient", "math")),
        ("cuda", BF16, {"capability": (8, 9), "cudnn_version": 91600}, "flash", ("flash", "efficient", "math")),
        ("cuda", BF16, {"capability": (7, 5), "cudnn_version": 91600}, "efficient", ("efficient", "math")),
        ("cuda", FP32, {"capability": (9, 0), "cudnn_version": 91600}, "efficient", ("efficient", "math")),
        ("cuda", BF16, {}, "auto", ("cudnn", "flash", "efficient", "math")),  # no GPU to ask: decided at start
    ],
)  # fmt: skip
def test_auto_picks_torchs_own_preference_and_says_why(device, dtype, facts, name, order):
    kernel = _resolve("auto", device, dtype, **facts)
    assert (kernel.name, kernel.order, kernel.model_backend) == (name, order, "auto")
    assert kernel.reason.startswith("auto") or kernel.reason.startswith("decided at start"), kernel.reason
    if "capability" in facts:
        sm = "sm{}{}".format(*facts["capability"])
        assert sm in kernel.reason or "float32" in kernel.reason, kernel.reason


def test_auto_names_the_document_mask_kernel_on_cuda():
    kernel = _resolve("auto", "cuda", BF16, capability=(8, 0), document_masking=True)
    assert kernel.name == "flash" and "packed documents' mask: flex" in kernel.reason


@pytest.mark.parametrize("name", ["flash", "math"])
def test_a_kernel_asked_by_name_is_the_only_one(name):
    kernel = _resolve(name)
    assert (kernel.name, kernel.order, kernel.model_backend) == (name, (name,), "sdpa")
    assert "trainer.attention.backend" in kernel.reason


@pytest.mark.parametrize(
    ("backend", "device", "dtype", "facts", "expect"),
    [
        ("efficient", "cpu", FP32, {}, "efficient cannot run on CPU"),
        ("cudnn", "cpu", FP32, {}, "cudnn cannot run on CPU"),
        ("flex", "cpu", FP32, {}, "flex cannot train on CPU"),
        ("flash", "cuda", FP32, {}, "flash takes bfloat16/float16 only on CUDA"),
        ("cudnn", "cuda", FP32, {}, "cudnn takes bfloat16/float16 only on CUDA"),
        ("flash", "cuda", BF16, {"capability": (7, 5)}, "needs a GPU of compute capability 8.0 (sm80)"),
        ("cudnn", "cuda", BF16, {"capability": (7, 0)}, "this one is sm70"),
        ("flash", "cuda", BF16, {"document_masking": True}, "flash takes no attention mask"),
        ("flex", "cuda", BF16, {"context_parallel": 2}, "flex with mesh.context_parallel=2"),
    ],
)  # fmt: skip
def test_a_kernel_that_cannot_run_is_one_line_naming_the_key_and_the_fix(
    backend, device, dtype, facts, expect
):
    with pytest.raises(ParallelizeError) as caught:
        _resolve(backend, device, dtype, **facts)
    message = str(caught.value)
    assert expect in message and "\n" not in message, message
    assert message.startswith("trainer.attention.backend: ") and "use " in message, message


@pytest.mark.parametrize(
    ("backend", "device", "dtype", "facts"),
    [
        ("flash", "cpu", FP32, {"document_masking": True}),  # the CPU kernel takes masks
        ("efficient", "cuda", FP32, {"document_masking": True, "capability": (7, 5)}),
        ("cudnn", "cuda", BF16, {"capability": (9, 0), "context_parallel": 2}),
        ("flex", "cuda", BF16, {"document_masking": True}),
        ("math", "cpu", BF16, {}),
    ],
)  # fmt: skip
def test_what_can_run_is_accepted(backend, device, dtype, facts):
    assert _resolve(backend, device, dtype, **facts).name == backend


def test_flex_on_a_torch_without_it_is_refused(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if "flex_attention" in name else real(name, *a)
    )
    with pytest.raises(ParallelizeError, match="has no FlexAttention"):
        _resolve("flex", "cuda", BF16)


def _kernel_ops(kernel) -> collections.Counter:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 16, generator=gen, requires_grad=True) for _ in range(2))
    with profile(activities=[ProfilerActivity.CPU]) as prof, kernel.sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    names = {op for ops in CPU_OPS.values() for op in ops}
    return collections.Counter(e.name for e in prof.events() if e.name in names)


@pytest.mark.parametrize("backend", ["auto", "flash", "math"])
def test_sdpa_runs_the_kernel_asked_forward_and_backward_on_cpu(backend):
    kernel = _resolve(backend)
    counts = _kernel_ops(kernel)
    assert counts == collections.Counter(dict.fromkeys(CPU_OPS[kernel.name], 1)), counts


def test_the_restriction_ends_with_the_block():
    _kernel_ops(_resolve("math"))
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert _kernel_ops(_resolve("flash"))["aten::_scaled_dot_product_flash_attention_for_cpu"] == 1


class _Declares(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_backend = "auto"
        self.inner = nn.Linear(2, 2)


@pytest.mark.parametrize(("backend", "declared"), [("flex", "flex"), ("math", "sdpa"), ("auto", "auto")])
def test_modules_that_declare_an_attention_backend_get_the_kernels_family(backend, declared):
    root = nn.Sequential(_Declares(), nn.Linear(2, 2), nn.Sequential(_Declares()))
    device, dtype = ("cuda", BF16) if backend == "flex" else ("cpu", FP32)
    assert apply_attention_kernel(root, _resolve(backend, device, dtype)) == 2
    assert [m.attention_backend for m in root.modules() if hasattr(m, "attention_backend")] == [declared] * 2
    assert apply_attention_kernel(root, None) == 0
