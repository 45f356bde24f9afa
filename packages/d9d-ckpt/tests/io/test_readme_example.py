"""The README's standalone example runs as written (map to HF names, save, load back)."""

import re
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"


def test_readme_export_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme"})
    assert sorted(p.name for p in (tmp_path / "hf_export").iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
