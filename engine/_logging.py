"""Making the library's INFO lines visible when the application configured no logging.

``LoaderConfig.log_stats`` logs one line per step on the ``"evenflow"`` logger. Python shows
nothing below WARNING until the application configures logging, so by default those lines
would vanish. As common libraries do, the first loader that logs statistics gives the
``"evenflow"`` logger a handler of its own (standard error, INFO) — but only while the
application has configured none: the handler steps aside as soon as the root logger has a
handler (``logging.basicConfig``, a framework, pytest), so lines are never printed twice, and
an application that sets the ``"evenflow"`` logger's level or handlers itself is left alone.
"""

from __future__ import annotations

import logging
import sys
import threading

__all__ = ["show_info_lines"]

_lock = threading.Lock()


class _UnlessConfigured(logging.Filter):
    """Pass records only while the root logger has no handler (the application's own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


class _DefaultHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`show_info_lines` installs (recognised by its type)."""


def show_info_lines() -> None:
    """Give the ``"evenflow"`` logger a default INFO handler unless logging is configured."""
    logger = logging.getLogger("evenflow")
    with _lock:
        if logger.handlers or logger.level != logging.NOTSET:
            return  # the application chose, or this already ran
        if logging.getLogger().handlers:
            return  # the application configured logging: its handlers show our lines
        handler = _DefaultHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("evenflow: %(message)s"))
        handler.addFilter(_UnlessConfigured())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
