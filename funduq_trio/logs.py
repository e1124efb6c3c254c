"""How `funduq-trio serve` logs: one handler on stderr, text or JSON lines.

Everything funduq says goes through loggers named ``funduq_trio.*`` (the
front's own messages are ``funduq_trio.server``'s), so ``--log-level`` and
``--log-format`` govern all of it. The access log is a separate logger,
``funduq_trio.access``, which the front writes only when ``FUNDUQ_ACCESS_LOG``
is on.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import IO, Any

__all__ = ["JsonFormatter", "TEXT_FORMAT", "configure_logging"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (and the
    exception's traceback as text, when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str, fmt: str, stream: IO[str] | None = None) -> None:
    """Replace the root logger's handlers with one on `stream` (stderr)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
