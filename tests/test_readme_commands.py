"""The commands of the top-level README run as printed, in the order a reader meets them.

In a temporary copy of `examples/`, through tests/_doc_commands.py (as docs/*.md in
test_docs_commands.py): the quickstart trains with a small step count added (the only change), then
every `uv run d9d ...` runs there, `d9d metrics` on the run the quickstart just wrote. Left out, each
for its reason in `EXCLUDED`: the install, the test suite itself, and the torchrun command, which
docs/quickstart.md prints too and its test runs.
"""

from _doc_commands import ROOT, PageRunner, copy_examples, left_behind, page_commands

README = "README.md"
COMMANDS, MISPLACED = page_commands(ROOT / README)
QUICKSTART_PAGE, _ = page_commands(ROOT / "docs" / "quickstart.md")
EXCLUDED = {
    (README, "uv sync"): "installs the workspace: this test runs in the environment it made",
    (README, "uv run pytest"): "the test suite this test is part of",
    (README, "uv run pytest packages/d9d-mesh"): "a part of the test suite this test is part of",
} | {
    (README, c.text): "docs/quickstart.md prints the same command after the same first run; "
    "test_docs_commands.py runs it there"
    for c in COMMANDS
    if c.text.startswith("uv run torchrun")
}


def test_the_readme_shows_the_commands_this_test_runs():
    assert not MISPLACED, [str(m) for m in MISPLACED]
    kinds = [c.text.split()[2] for c in COMMANDS if c.text.startswith("uv run ")]
    assert kinds.count("python") == 1 and "d9d" in kinds and "pytest" in kinds, kinds
    torchrun = [c.text for c in COMMANDS if c.text.startswith("uv run torchrun")]
    assert torchrun and set(torchrun) <= {c.text for c in QUICKSTART_PAGE if c.not_run is None}, torchrun
    assert all(key in {(README, c.text) for c in COMMANDS} for key in EXCLUDED), EXCLUDED


def test_the_readme_commands_run_as_printed(tmp_path):
    runner = PageRunner(copy_examples(tmp_path), EXCLUDED)
    runner.run_page(COMMANDS)
    ran = [r.command.text.split()[2] for r in runner.ran]
    assert ran.count("python") == 1 and ran.count("d9d") >= 3, ran
    assert not left_behind(tmp_path), f"README commands leave untracked files: {left_behind(tmp_path)[:5]}"
