import io

import torch

from d9d.trainer.metrics import ProgressLine, device_peak_flops, mfu, model_flops_per_token


class _Config:
    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * 1000 + seq_len


class _Model(torch.nn.Module):
    config = _Config()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_mfu_only_with_known_peak_and_flops():
    assert device_peak_flops(torch.device("cpu")) is None  # unknown device: no made-up number
    assert mfu(1000.0, None, 1e12, 1) == {}
    assert mfu(1000.0, 6e6, None, 1) == {}
    assert mfu(1000.0, 6e6, 1e12, 2) == {"mfu": round(1000 * 6e6 / 2e12, 4)}
    assert model_flops_per_token(_Model(), 128) == 6128.0
    assert model_flops_per_token(torch.nn.Linear(2, 2), 128) is None


def test_progress_line_only_on_a_terminal():
    tty, pipe = _Tty(), io.StringIO()
    for stream in (tty, pipe):
        line = ProgressLine(total=10, start=0, stream=stream)
        line.update(5, 1.5)
        line.close()
    assert "5/10 loss 1.5000" in tty.getvalue() and tty.getvalue().startswith("\r[")
    assert pipe.getvalue() == ""
