import contextlib
import io
import os
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
REPO = PACKAGE.parents[1]


def test_readme_examples_run_from_the_repository_root(monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", (PACKAGE / "README.md").read_text(), flags=re.S)
    assert len(blocks) == 4
    monkeypatch.chdir(REPO)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    out = io.StringIO()
    namespace = {}
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert "8 microbatches per step" in out.getvalue()
    resumed, state = namespace["resumed"], namespace["state"]
    assert (state["epoch"], state["position"]) == (0, 96) and resumed.position == 96
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[1], "README.md", "exec"), namespace)
    assert "400 of 400 records kept" in out.getvalue() and namespace["dataset"].packing_efficiency > 0.9
    assert namespace["out"].shape == (1, 1, 64, 8)
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[2], "README.md", "exec"), namespace)
    assert "81 of 81 preference pairs kept" in out.getvalue() and "0 [0, 1, 2, 3]" in out.getvalue()
    exec(compile(blocks[3], "README.md", "exec"), namespace)
    from d9d.data import DataProvider

    assert isinstance(namespace["RepeatProvider"](None), DataProvider)
    assert os.path.getsize(REPO / "examples" / "data" / "corpus.txt") < 500_000
