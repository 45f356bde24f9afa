"""Rank-tagged logging: every rank logs to stdout through structlog, optionally to a file per rank.

Each line carries the rank and its mesh coordinates (or `local`), so the interleaved output of many
ranks stays readable. Standard-library `logging` records (torch's own, warnings) go through the same
pipeline. Two renderings: `console` for people, `json` (one object per line) for machines.

Console line format::

    2026-11-29T19:40:01.123Z INFO    [rank 1 dps1 tp0] d9d.trainer: job built  run=quickstart

i.e. UTC timestamp, level, [rank tag], logger name, event, then `key=value` pairs.
"""

import datetime
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

import structlog

from d9d.mesh.layout import rank_tag

if TYPE_CHECKING:  # only for annotations: logging works before torch is imported
    from d9d.mesh.context import DistributedContext

__all__ = ["LogFormat", "configure_logging", "get_logger", "rank_log_path"]

LogFormat = Literal["console", "json"]

_HANDLER_MARK = "_d9d_handler"
_LABEL_WIDTH = 45
#: Libraries that install their own stderr handlers (and stop propagation) on import.
_SELF_HANDLED_LOGGERS = ("torch",)


class _RankInfo:
    """What the rank processor stamps on every record; updated by `configure_logging`."""

    def __init__(self) -> None:
        rank = os.environ.get("RANK")
        self.rank: int | str = int(rank) if rank is not None and rank.isdigit() else "local"
        self.tag = "local" if self.rank == "local" else f"rank {self.rank}"
        self.coords: dict[str, int] = {}
        self.tag_width = len(self.tag)


_RANK = _RankInfo()


def _add_rank(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    event_dict.setdefault("rank", _RANK.rank)
    if _RANK.coords:
        event_dict.setdefault("coords", _RANK.coords)
    return event_dict


def _add_timestamp(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    record = event_dict.get("_record")  # a stdlib record: stamp its creation time, not format time
    now = (
        datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        if record is not None
        else datetime.datetime.now(datetime.UTC)
    )
    event_dict.setdefault("timestamp", now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z")
    return event_dict


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    if (" " in text or not text) and not isinstance(value, (dict, list, tuple)):
        # quoted as written (a regex's backslashes stay single), escaped only where it must be
        return f"'{text}'" if text.isprintable() and "'" not in text else repr(text)
    return text


def _render_console(_logger: Any, _method: str, event_dict: dict[str, Any]) -> str:
    event_dict = dict(event_dict)
    timestamp = event_dict.pop("timestamp", "")
    level = str(event_dict.pop("level", "info")).upper()
    name = event_dict.pop("logger", None) or event_dict.pop("logger_name", "")
    event_dict.pop("rank", None)
    event_dict.pop("coords", None)
    event = str(event_dict.pop("event", ""))
    exception = event_dict.pop("exception", None)
    stack = event_dict.pop("stack", None)
    tag = f"[{_RANK.tag}]".ljust(_RANK.tag_width + 2)
    head = f"{timestamp} {level:<7} {tag} "
    label = f"{name}: {event}" if name else event  # padded together: columns line up across loggers
    pairs = "  ".join(f"{k}={_format_value(v)}" for k, v in event_dict.items())
    line = head + (f"{label:<{_LABEL_WIDTH}}  {pairs}" if pairs else label)
    for extra in (stack, exception):
        if extra:
            line += "\n" + str(extra)
    return line.rstrip()


def _render_json(_logger: Any, _method: str, event_dict: dict[str, Any]) -> str:
    return json.dumps(event_dict, default=str, ensure_ascii=False)


def _shared_processors() -> list[Any]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        _add_timestamp,
        _add_rank,
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]


class _StartupBuffer(logging.Handler):
    """Keeps the records logged before a log file exists (the first `capacity` of them)."""

    capacity = 10_000

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.dropped = 0
        self.pid = os.getpid()  # a forked child inherits the parent's buffer: it is not its start-up

    def emit(self, record: logging.LogRecord) -> None:
        if self.pid != os.getpid():
            self.records, self.dropped, self.pid = [], 0, os.getpid()
        if len(self.records) < self.capacity:
            self.records.append(record)
        else:
            self.dropped += 1


def rank_log_path(log_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank `rank` writes its log file under `log_dir`: `<log_dir>/rank-<rank>.log`."""
    return Path(log_dir) / f"rank-{rank}.log"


def configure_logging(
    context: "DistributedContext | None" = None,
    *,
    format: LogFormat = "console",
    log_dir: str | os.PathLike[str] | None = None,
    level: int | str = "INFO",
    stream: TextIO | None = None,
) -> None:
    """Send structlog and standard-library logging of this process to stdout (and a per-rank file).

    Call it again after the `DistributedContext` exists so lines carry the mesh coordinates; calling
    it again replaces the handlers it installed before.

    Args:
        context: where this rank sits; without one the tag comes from the RANK variable, or `local`.
        format: `console` (aligned text for people) or `json` (one JSON object per line).
        log_dir: when set, each rank also appends to `<log_dir>/rank-<N>.log`, starting with the lines
            logged since the last call without one (so a job that configures its file once it started
            cleanly still has its start-up lines there, and a failed start writes no file).
        level: minimum level, e.g. "INFO" or "DEBUG".
        stream: where to print instead of stdout (tests).
    """
    if format not in ("console", "json"):
        raise ValueError(f"log format must be 'console' or 'json', got {format!r}")
    if context is not None:
        _RANK.rank = "local" if context.is_local else context.rank
        _RANK.tag = context.log_tag
        _RANK.coords = {} if context.is_local else _visible_coords(context)
        _RANK.tag_width = len(_widest_tag(context))
    renderer = _render_console if format == "console" else _render_json
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_shared_processors(),
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handlers: list[logging.Handler] = [logging.StreamHandler(stream if stream is not None else sys.stdout)]
    root = logging.getLogger()
    buffered = next((h for h in root.handlers if isinstance(h, _StartupBuffer)), None)
    file_handler = None
    if log_dir is not None:
        rank = 0 if _RANK.rank == "local" else int(_RANK.rank)
        path = rank_log_path(log_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path, encoding="utf-8")
        handlers.append(file_handler)
    else:  # from here, keep the start-up lines for a log file configured later (once the job is sound)
        handlers.append(_StartupBuffer())
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
        old.close()
    if file_handler is not None and buffered is not None and buffered.pid == os.getpid():
        file_handler.setFormatter(formatter)
        for record in buffered.records:
            file_handler.handle(record)
        if buffered.dropped:
            file_handler.handle(
                logging.makeLogRecord({"name": "d9d.mesh", "levelno": logging.WARNING, "levelname": "WARNING",
                                       "msg": f"{buffered.dropped} earlier start-up log lines were not kept"})
            )  # fmt: skip
        buffered.records.clear()
    for handler in handlers:
        setattr(handler, _HANDLER_MARK, True)
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    for name in _SELF_HANDLED_LOGGERS:  # torch prints through its own handlers; route it through ours
        library = logging.getLogger(name)
        for old in list(library.handlers):
            library.removeHandler(old)
        library.propagate = True
    logging.captureWarnings(False)  # re-capture: someone (e.g. pytest) may have replaced showwarning since
    logging.captureWarnings(True)
    structlog.configure(
        processors=[*_shared_processors(), structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    """A structlog logger; its lines carry the rank tag once `configure_logging` ran."""
    return structlog.stdlib.get_logger(name)


def _visible_coords(context: "DistributedContext") -> dict[str, int]:
    """Coordinates on the axes that are larger than 1 (dense domain, plus ep_shard)."""
    coords = {
        axis: value for axis, value in context.coordinates["dense"].items() if context.axis_size(axis) > 1
    }
    if context.config.expert_parallel > 1:
        coords["ep_shard"] = context.coordinate("ep_shard")
    return coords


def _widest_tag(context: "DistributedContext") -> str:
    """The tag of the last rank: it has the most digits, so all ranks pad to the same column."""
    return context.log_tag if context.is_local else rank_tag(context.config, context.world_size - 1)
