"""structlog set-up shared by every role: JSON lines when not on a terminal."""
from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info", json_output: bool | None = None) -> None:
    """Configure structlog for this process; `json_output` defaults to "stderr is not a TTY"."""
    if json_output is None:
        json_output = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json_output else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger
