"""Process-wide log configuration: structlog and the standard library write through one handler.

Owns the choice of output (JSON lines for journald and collectors when stderr is not a terminal, a
readable console rendering when a person is watching), the common fields (ISO UTC timestamp, level,
logger name) and the routing of stdlib loggers (asyncio, torch, our own) and warnings into the same
stream. Daemons call configure_logging once, from cli.py, before anything logs; library modules
only ask for loggers. Must not import torch, dilocod.transport or dilocod.wire.
"""

from __future__ import annotations

import logging
import sys

import structlog

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _is_terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def _strip_event(
    logger: object, method_name: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    # warnings.formatwarning ends its text with a newline, which would split a console line.
    event = event_dict.get("event")
    if isinstance(event, str):
        event_dict["event"] = event.rstrip()
    return event_dict


def configure_logging(*, json: bool | None = None, level: str = "info") -> None:
    """Route structlog and stdlib logging to stderr, as JSON lines or for a terminal.

    json=None picks JSON unless stderr is a terminal. `level` is one of LEVELS (any case); an unknown
    level raises ValueError so the caller can report the configuration key. Calling again replaces
    the previous configuration instead of adding a second handler.
    """
    numeric_level = LEVELS.get(level.lower())
    if numeric_level is None:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LEVELS)}")
    as_json = not _is_terminal(sys.stderr) if json is None else json

    # Applied to every record, whether it started in structlog or in a stdlib logger.
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.stdlib.ExtraAdder(),
        _strip_event,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.typing.Processor
    if as_json:
        # Tracebacks become one string field so that each record stays on one line.
        final: list[structlog.typing.Processor] = [structlog.processors.format_exc_info]
        renderer = structlog.processors.JSONRenderer()
    else:
        final = []
        renderer = structlog.dev.ConsoleRenderer(colors=_is_terminal(sys.stderr))

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.stdlib.PositionalArgumentsFormatter(),
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)

    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric_level)
    # warnings.warn (torch's, for one) then arrives as a "py.warnings" record in the same stream.
    logging.captureWarnings(True)
