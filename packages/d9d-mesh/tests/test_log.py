import io
import json
import logging
import re
import warnings

import pytest

from d9d.mesh import DistributedContext, MeshConfig, configure_logging, get_logger, rank_log_path, rank_tag
from d9d.mesh.testing import run_distributed

LINE = re.compile(r"^\S+Z (?P<level>[A-Z]+) +(?P<tag>\[[^\]]+\] *) (?P<logger>[\w.]+): (?P<event>.*)$")


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    configure_logging(stream=io.StringIO())  # detach from the test's stream


def _log_on_rank(config, log_dir):
    stream = io.StringIO()
    with DistributedContext.from_env(config) as ctx:
        configure_logging(ctx, stream=stream, log_dir=log_dir)
        get_logger("d9d.test").info("step done", step=3, loss=1.25, note="two words")
        get_logger("d9d.ckpt").info("checkpoint committed", step=2, path="/runs/quickstart/save-2")
        get_logger("d9d.trainer").warning(  # a label of 43 characters: just within the padded width
            "resumed with a changed setting", key="trainer.determinism.seed", checkpoint=0, now=1
        )
        logging.getLogger("some.library").warning("plain stdlib record")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a python warning", UserWarning, stacklevel=1)
        try:
            raise RuntimeError("shown with its traceback")
        except RuntimeError:
            get_logger("d9d.test").exception("caught")
        return stream.getvalue()


def test_every_rank_tags_its_lines_and_writes_its_own_file(tmp_path):
    config = MeshConfig(data_parallel_shard=2, tensor_parallel=2, expert_parallel=2)
    outputs = run_distributed(_log_on_rank, 4, config, str(tmp_path))
    widths = set()
    for rank, text in enumerate(outputs):
        lines = [m for m in map(LINE.match, text.splitlines()) if m]
        assert {m["tag"].strip() for m in lines} == {f"[{rank_tag(config, rank)}]"}
        widths.update(len(m["tag"]) for m in lines)
        events = {m["logger"]: m["event"] for m in lines}
        assert re.search(r"step done +step=3  loss=1.25  note='two words'", text)
        assert events["some.library"] == "plain stdlib record"
        assert "py.warnings" in events and "a python warning" in events["py.warnings"]
        assert "RuntimeError: shown with its traceback" in text and "Traceback" in text
        assert rank_log_path(tmp_path, rank).read_text() == text
    assert len(widths) == 1  # columns align across ranks


#: Where a console line's first `key=value` pair starts: after the label's padding, two spaces.
FIRST_PAIR = re.compile(r"  (?=[a-z_]+=)")


def test_key_value_columns_line_up_across_loggers_levels_and_ranks(tmp_path):
    outputs = run_distributed(_log_on_rank, 2, MeshConfig(data_parallel_shard=2), str(tmp_path))
    columns: dict[int, list[str]] = {}
    for text in outputs:
        for line in text.splitlines():
            found = LINE.match(line)
            pair = FIRST_PAIR.search(line)
            if found and pair:  # a line with fields (the stdlib records and the warning have none)
                columns.setdefault(pair.end(), []).append(f"{found['logger']}: {found['event']}")
    labels = {label.split("  ")[0] for found in columns.values() for label in found}
    assert {"d9d.test: step done", "d9d.ckpt: checkpoint committed",
            "d9d.trainer: resumed with a changed setting"} <= labels, labels  # fmt: skip
    assert len(columns) == 1, f"the fields start in more than one column: {columns}"


def test_local_mode_tag_and_json_format():
    stream = io.StringIO()
    ctx = DistributedContext.from_env(MeshConfig(), environ={}, device="cpu")
    configure_logging(ctx, stream=stream, format="json")
    get_logger("d9d.test").info("hello", value=2)
    record = json.loads(stream.getvalue().splitlines()[-1])
    assert record["rank"] == "local" and record["event"] == "hello" and record["value"] == 2
    assert record["level"] == "info" and record["logger"] == "d9d.test"
    assert "coords" not in record


def test_a_value_with_spaces_is_quoted_as_written_and_escaped_only_where_it_must_be():
    stream = io.StringIO()
    configure_logging(stream=stream)
    pattern = r".*\.(q_proj|v_proj): 2 in each of 4 layers"  # a regex: its backslash stays single
    get_logger("d9d.test").info("quoted", regex=pattern, quote="it's here", lines="a b\nc", word=r"a\b")
    line = stream.getvalue().splitlines()[-1]
    assert f"regex='{pattern}'" in line and r"word=a\b" in line
    assert 'quote="it\'s here"' in line and r"lines='a b\nc'" in line  # repr: unambiguous


def test_reconfiguring_replaces_handlers():
    first, second = io.StringIO(), io.StringIO()
    configure_logging(stream=first)
    configure_logging(stream=second)
    get_logger("x").info("only once")
    assert first.getvalue() == "" and second.getvalue().count("only once") == 1


def test_bad_format_is_rejected():
    with pytest.raises(ValueError, match="log format must be 'console' or 'json'"):
        configure_logging(format="xml")  # type: ignore[arg-type]


def test_a_log_file_configured_later_starts_with_the_lines_logged_before_it(tmp_path):
    get_logger("d9d.test").info("an earlier job's line")
    configure_logging(stream=io.StringIO())  # a job starts: from here its lines are kept for its file
    get_logger("d9d.test").info("start-up line", step=0)
    logging.getLogger("some.library").warning("plain stdlib start-up record")
    configure_logging(stream=io.StringIO(), log_dir=tmp_path)
    get_logger("d9d.test").info("after the file", step=1)
    configure_logging(stream=io.StringIO(), log_dir=tmp_path)  # a second file configuration replays nothing
    lines = rank_log_path(tmp_path, 0).read_text().splitlines()
    events = [LINE.match(line).group("event").split("  ")[0].strip() for line in lines]
    assert events == ["start-up line", "plain stdlib start-up record", "after the file"]


def _file_lines_of_a_forked_rank(config, log_dir):
    with DistributedContext.from_env(config) as ctx:
        configure_logging(ctx, stream=io.StringIO(), log_dir=log_dir)
        get_logger("d9d.test").info("the rank's own line")
    return rank_log_path(log_dir, ctx.rank).read_text()


def test_a_forked_rank_does_not_replay_its_parents_start_up_lines(tmp_path):
    configure_logging(stream=io.StringIO())
    get_logger("d9d.test").info("the parent's line")
    texts = run_distributed(_file_lines_of_a_forked_rank, 2, MeshConfig(data_parallel_shard=2), str(tmp_path))
    for text in texts:
        assert "the rank's own line" in text and "the parent's line" not in text
