"""metrics.jsonl: one reader with one damage rule, for resume (truncate) and `d9d metrics` alike."""

import json
import subprocess
import sys

from d9d.trainer.observe.metrics_file import METRICS_FILE, read_metrics_file, truncate_metrics


def _lines(*steps: int) -> list[str]:
    return [json.dumps({"step": s, "loss": 1.0 / s}) for s in steps]


def test_damaged_lines_are_skipped_and_counted_wherever_they_are(tmp_path):
    path = tmp_path / METRICS_FILE
    good = _lines(1, 2, 3)
    path.write_text("\n".join([good[0], '{"step": 2, "lo', good[1], "[1, 2]", "", good[2]]) + "\n")
    read = read_metrics_file(path)
    assert [r["step"] for r in read.records] == [1, 2, 3]
    assert read.damaged == [2, 4]  # a cut line and a JSON value that is not a record
    assert read.lines == good
    assert read_metrics_file(tmp_path / "missing.jsonl").records == []


def test_truncate_keeps_the_records_up_to_the_step_and_drops_damage(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text("\n".join([*_lines(1, 2), "\x00\xff garbage", *_lines(3, 4)]) + "\n", encoding="utf-8")
    assert truncate_metrics(path, 3) == [3]  # the damaged line's number, for the caller's warning
    assert path.read_text(encoding="utf-8") == "\n".join(_lines(1, 2, 3)) + "\n"
    assert truncate_metrics(tmp_path / "none.jsonl", 3) == []
    assert not (tmp_path / "none.jsonl").exists()


def test_the_reader_imports_no_torch():
    code = "import sys; import d9d.trainer.observe.metrics_file; from d9d.trainer import read_metrics; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
