"""Throughput accounting: tokens/s, model FLOPs utilization against known device peaks, progress line."""

import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol, TextIO, runtime_checkable

import torch

__all__ = [
    "PEAK_TFLOPS_BF16",
    "ProgressLine",
    "batch_flops_per_token",
    "device_peak_flops",
    "model_flops_per_token",
    "named_peak_flops",
]

#: Dense bf16 peak TFLOP/s of devices whose peak is known (name substring → TFLOP/s), the more specific
#: names first: "NVIDIA H100 NVL" and "NVIDIA H200 NVL" (835) must not match the SXM parts' "H100" and
#: "H200" (989). A device not listed gets no MFU: never a made-up number.
PEAK_TFLOPS_BF16: dict[str, float] = {
    "H200 NVL": 835.0,
    "H200": 989.0,
    "H100 NVL": 835.0,
    "H100 SXM": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
}


def named_peak_flops(name: str) -> float | None:
    """Peak dense bf16 FLOP/s of the device called `name` (as `torch.cuda.get_device_name` says it):
    the first `PEAK_TFLOPS_BF16` key it contains, or None."""
    for key, tflops in PEAK_TFLOPS_BF16.items():
        if key in name:
            return tflops * 1e12
    return None


def device_peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`, or None when it is not in `PEAK_TFLOPS_BF16` (e.g. a CPU)."""
    if device.type != "cuda":
        return None
    return named_peak_flops(torch.cuda.get_device_name(device))


@runtime_checkable
class CountsFlops(Protocol):
    """A model, or a model's `config` (Hugging Face's place for it), that counts its training FLOPs."""

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at sequence length `seq_len`."""
        ...


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token when the model (or its `config`) is `CountsFlops`; None otherwise."""
    for owner in (model, getattr(model, "config", None)):  # `config`: the model's own attribute, if any
        if isinstance(owner, CountsFlops):
            return float(owner.flops_per_token(seq_len))
    return None


def batch_flops_per_token(model: torch.nn.Module, microbatches: Sequence[Any]) -> float | None:
    """`model_flops_per_token` at the sequence length of a step's first microbatch (`input_ids`)."""
    if microbatches and isinstance(microbatches[0], dict):
        ids = microbatches[0].get("input_ids")
        if ids is not None:
            return model_flops_per_token(model, int(ids.shape[-1]))
    return None


class ProgressLine:
    """A one-line progress display on a terminal (rewritten in place); silent when not a terminal."""

    def __init__(self, total: int, start: int, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = self._stream.isatty()
        self._total, self._start = total, start
        self._t0 = time.perf_counter()
        self._shown = ""
        self._handlers: list[logging.Handler] = []
        if self._enabled:  # a log line first clears the progress line, which the next update redraws
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and _is_terminal(handler.stream):
                    handler.addFilter(self._clear_before_log)
                    self._handlers.append(handler)

    def _clear_before_log(self, record: logging.LogRecord) -> bool:
        if self._shown:
            self._stream.write("\r\033[K")
            self._stream.flush()
            self._shown = ""
        return True

    def update(self, step: int, loss: float | None, loss_step: int | None = None) -> None:
        """Show `step/total`, the last logged loss (None: none yet) with the step it is from (it is
        read at logging steps only: reading every step's loss would wait for the device) and the time
        left."""
        if not self._enabled:
            return
        done = step - self._start
        rate = done / max(time.perf_counter() - self._t0, 1e-9)
        left = (self._total - step) / rate if rate > 0 else 0.0
        width = 30
        filled = int(width * step / self._total)
        bar = "#" * filled + "." * (width - filled)
        shown = f"{loss:.4f}" if loss is not None else "-"
        if loss is not None and loss_step is not None and loss_step != step:
            shown += f" (step {loss_step})"
        self._shown = f"[{bar}] {step}/{self._total} loss {shown} eta {left:5.0f}s "
        self._stream.write("\r" + self._shown)
        self._stream.flush()

    def close(self) -> None:
        """End the line and stop clearing it before log lines."""
        for handler in self._handlers:
            handler.removeFilter(self._clear_before_log)
        self._handlers.clear()
        if self._enabled and self._shown:
            self._stream.write("\n")
            self._stream.flush()
            self._shown = ""


def mfu(
    tokens_per_s: float, flops_per_token: float | None, peak: float | None, world_size: int
) -> dict[str, Any]:
    """{"mfu": fraction} when both the model's FLOPs and the device peak are known, else {}."""
    if flops_per_token is None or peak is None:
        return {}
    return {"mfu": round(tokens_per_s * flops_per_token / (peak * world_size), 4)}


def _is_terminal(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
