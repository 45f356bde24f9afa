import io

import torch

from d9d.trainer.observe.throughput import (
    PEAK_TFLOPS_BF16,
    ProgressLine,
    device_peak_flops,
    mfu,
    model_flops_per_token,
    named_peak_flops,
)


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


def test_each_device_name_gets_its_own_parts_peak_not_a_shorter_names():
    # the names torch.cuda.get_device_name gives: an NVL part contains the SXM part's short name
    for name, key in (
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
    ):
        assert named_peak_flops(name) == PEAK_TFLOPS_BF16[key] * 1e12, name
    assert PEAK_TFLOPS_BF16["H100 NVL"] != PEAK_TFLOPS_BF16["H100"]
    assert PEAK_TFLOPS_BF16["H200 NVL"] != PEAK_TFLOPS_BF16["H200"]
    assert named_peak_flops("Tesla V100-SXM2-16GB") is None


def test_progress_line_only_on_a_terminal():
    tty, pipe = _Tty(), io.StringIO()
    for stream in (tty, pipe):
        line = ProgressLine(total=10, start=0, stream=stream)
        line.update(5, 1.5)
        line.close()
    assert "5/10 loss 1.5000" in tty.getvalue() and tty.getvalue().startswith("\r[")
    assert pipe.getvalue() == ""


def test_a_log_line_clears_the_progress_line_first():
    import logging

    tty = _Tty()
    handler = logging.StreamHandler(tty)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        line = ProgressLine(total=10, start=0, stream=tty)
        line.update(3, 2.0)
        logging.getLogger("d9d.test").warning("a log line")
        line.update(4, 1.9)
        line.close()
        logging.getLogger("d9d.test").warning("after the end")
    finally:
        root.removeHandler(handler)
    out = tty.getvalue()
    cleared = out.index("\r\033[K")
    assert out.index("3/10") < cleared < out.index("a log line") < out.index("4/10")
    assert out.count("\r\033[K") == 1  # after close() the handler is left alone
    assert out.endswith("after the end\n")


def test_the_progress_line_shows_a_logging_steps_own_loss_and_names_the_step_of_an_older_one(tmp_path):
    from d9d.trainer.observe.records import StepRecords
    from d9d.trainer.step.base import StepOutput

    tty = _Tty()
    records = StepRecords(tmp_path / "metrics.jsonl", writer=True, total=6, period=3, launch="l", peak_flops=None,
                         world_size=1, device=torch.device("cpu"), progress=ProgressLine(6, 0, stream=tty))  # fmt: skip
    shown = []
    for step in range(1, 7):
        loss = torch.tensor(float(step), dtype=torch.float64)
        records.add(step, StepOutput(loss, loss, torch.tensor(4.0, dtype=torch.float64), True),
                    lr=0.1, step_time_s=0.01)  # fmt: skip
        shown.append(tty.getvalue().rsplit("\r", 1)[-1])
    records.close()
    # steps 1 (the first), 3 and 6 are logging steps: their own loss; the others name the step
    assert "1/6 loss 1.0000 eta" in shown[0]
    assert "2/6 loss 1.0000 (step 1) eta" in shown[1]
    assert "3/6 loss 3.0000 eta" in shown[2]
    assert "5/6 loss 3.0000 (step 3) eta" in shown[4]
    assert "6/6 loss 6.0000 eta" in shown[5]
