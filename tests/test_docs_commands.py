"""Every shell command of docs/*.md runs as printed, in the order a reader meets it within its page.

Each page runs in its own copy of `examples/` (tests/_doc_commands.py: what counts as a command, how
each kind runs, the one change made: a small step count on training commands). A command is left out
only by a `<!-- not-run: REASON -->` line right before its block, or by `EXCLUDED` below; a command
the runner cannot run fails, so a page cannot gain a command that is neither run nor excluded.
"""

import shutil
from pathlib import Path

import pytest
from _doc_commands import ROOT, Command, PageRunner, copy_examples, left_behind, page_commands

PAGES = sorted((ROOT / "docs").glob("*.md"))
#: Single commands not run, with why (whole blocks are marked not-run in the page itself).
EXCLUDED = {
    ("docs/quickstart.md", "pip install uv"): "installs uv, which runs this suite already",
    ("docs/quickstart.md", "uv sync"): "installs the workspace: this test runs in the environment it made",
    ("docs/fine-tune.md", "uv sync --all-packages --extra chat"): (
        "installs packages: tokenizers and jinja2 are in the test environment already "
        "(transformers and torch depend on them)"
    ),
}
#: A page whose commands read what another page's commands wrote: it starts from a copy of that state.
CONTINUES = {"docs/monitoring.md": "docs/quickstart.md"}


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


COMMANDS = {_name(page): page_commands(page) for page in PAGES}


def _runnable(page: str) -> list[Command]:
    return [c for c in COMMANDS[page][0] if c.not_run is None and (page, c.text) not in EXCLUDED]


def test_every_command_of_the_docs_is_run_or_excluded_with_a_reason():
    misplaced = [str(m) for _, found in COMMANDS.values() for m in found]
    assert not misplaced, "\n".join(misplaced)
    shown = {(c.page, c.text) for commands, _ in COMMANDS.values() for c in commands}
    stale = [key for key in EXCLUDED if key not in shown]
    assert not stale, f"EXCLUDED names commands no page shows (any more): {stale}"
    marked = [c for commands, _ in COMMANDS.values() for c in commands if c.not_run is not None]
    assert marked and all((c.not_run or "").strip() for c in marked), [str(c) for c in marked]
    assert set(CONTINUES) | set(CONTINUES.values()) <= set(COMMANDS), CONTINUES
    # the parser misses no `uv run`: as many in the commands as in the pages' text
    for page in PAGES:
        commands, _ = COMMANDS[_name(page)]
        in_text = page.read_text(encoding="utf-8").count("uv run ")
        found = sum(c.text.count("uv run ") for c in commands)
        assert found == in_text, (
            f"{_name(page)} says `uv run ` {in_text} times, its commands {found}: put each command "
            "in a ```bash block or an inline code span"
        )
    kinds = {" ".join(c.text.split()[:3]) for page in COMMANDS for c in _runnable(page)}
    assert {"uv run python", "uv run d9d", "uv run torchrun"} <= kinds, kinds


@pytest.fixture(scope="module")
def run_page(tmp_path_factory):
    """page -> its runner, once the page's commands ran in its copy (each page runs once per module)."""
    done: dict[str, PageRunner] = {}

    def run(page: str) -> PageRunner:
        if page not in done:
            root = tmp_path_factory.mktemp(Path(page).stem)
            if page in CONTINUES:
                shutil.copytree(run(CONTINUES[page]).root, root, dirs_exist_ok=True)
            else:
                copy_examples(root)
            runner = PageRunner(root, EXCLUDED)
            runner.run_page(COMMANDS[page][0])
            done[page] = runner
        return done[page]

    return run


@pytest.mark.slow  # four pages launch torchrun
@pytest.mark.parametrize("page", sorted((p for p in COMMANDS if _runnable(p)), key=lambda p: p in CONTINUES))
def test_a_docs_page_runs_as_printed(page, run_page):
    runner = run_page(page)
    assert [r.command for r in runner.ran] == _runnable(page)
    stray = left_behind(runner.root)
    assert not stray, f"{page}'s commands leave files a clone shows as untracked: {stray[:5]} (write them "
    "under a run directory, or add them to .gitignore)"
    if page == "docs/fine-tune.md":  # its FSDP-2 command trains a run of its own, not the one before it
        (fsdp2,) = [r for r in runner.ran if "trainer.run.name=finetune-fsdp2" in r.command.text]
        assert "run is already complete" not in fsdp2.output and "checkpoint committed" in fsdp2.output
        run_dir = runner.root / "examples" / "finetune" / "runs" / "finetune-fsdp2"
        assert sorted(run_dir.glob("save-*")) and (run_dir.parent.parent / "export-fsdp2").is_dir()


def test_the_parser_finds_every_command_a_page_can_hold(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text with `uv run d9d plan a.yaml\n--world-size 2` inline.\n\n"
        "```bash\ncd dir   # a comment\nuv run python t.py c.yaml \\\n    k=v   # or: uv run d9d train c.yaml\n"
        "                 # a comment line alone\n```\n\n"
        "```console\n$ uv run d9d --help\nUsage: d9d ...\n```\n\n"
        "<!-- not-run: needs a cluster -->\n```sh\nsbatch job.sh\n```\n\n"
        "    d9d metrics runs/x\n\n```text\nuv run d9d metrics y\n```\n\n```python\nprint('uv run')\n```\n",
        encoding="utf-8",
    )
    commands, misplaced = page_commands(page)
    assert [(c.line, c.text, c.not_run) for c in commands] == [
        (1, "uv run d9d plan a.yaml --world-size 2", None),
        (5, "cd dir", None),
        (6, "uv run python t.py c.yaml k=v", None),
        (6, "uv run d9d train c.yaml", None),
        (12, "uv run d9d --help", None),
        (18, "sbatch job.sh", "needs a cluster"),
    ]
    assert [(m.line, m.text) for m in misplaced] == [(21, "d9d metrics runs/x"), (24, "uv run d9d metrics y")]
    page.write_text("<!-- not-run: a marker with no block -->\n\ntext\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="not right before a shell block"):
        page_commands(page)


def test_an_exits_marker_sets_the_status_a_blocks_commands_must_end_with(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- exits: 3 the job does not fit -->\n```bash\ncd .\n```\n\n```bash\ncd .\n```\n", encoding="utf-8"
    )
    commands, _ = page_commands(page)
    assert [(c.line, c.exits) for c in commands] == [(3, 3), (7, 0)]
    runner = PageRunner(tmp_path, {})
    runner.run(commands[1])
    with pytest.raises(AssertionError, match=r"page\.md:3: cd \.\nexit status 0, not 3"):
        runner.run(commands[0])
    page.write_text("<!-- exits: 3 no block follows -->\n\ntext\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="exits markers not right before a shell block"):
        page_commands(page)


def test_a_command_the_runner_does_not_know_fails_naming_page_and_line(tmp_path):
    with pytest.raises(AssertionError, match=r"docs/x\.md:3: make all: .*mark this one not run"):
        PageRunner(tmp_path, {}).run(Command("make all", "docs/x.md", 3))
