"""fitserve's log output: one stderr handler on the "fitserve" logger, like vLLM's default.

The engine installs it on first use so `LLM(...)` in a script shows the startup lines (model source,
memory figures); FITSERVE_CONFIGURE_LOGGING=0 leaves logging entirely to the application.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("fitserve")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%H:%M:%S"


class CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (tests and servers may swap it)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(level: int = logging.INFO) -> None:
    """One stderr handler on the "fitserve" logger; calling it again changes nothing."""
    if any(getattr(h, "fitserve_cli", False) for h in logger.handlers):
        return
    handler = CurrentStderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
    handler.fitserve_cli = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)


def configure_default_logging() -> None:
    if os.environ.get("FITSERVE_CONFIGURE_LOGGING", "1") != "0":
        setup_logging()
