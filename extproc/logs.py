"""Log output: readable text by default, or one JSON object per line (`log.format: json`).

Request-level lines carry their fields (`request_id`, `client_request_id`, `strategy`,
`reason`, `outcome`, `prefill`, `decode`) as JSON keys, not only in the message text.
"""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

__all__ = ["configure_logging"]

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter(_TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
