"""Imports of libraries that log through absl while they load (Orbax, grain).

absl calls `logging.basicConfig()` whenever it logs and the root logger has no handler yet, so
importing such a library leaves a root handler behind, after which an application's own
`logging.basicConfig(level=...)` does nothing. A library leaves the root logger to the
application: `quietly` imports a module and removes the handlers that appeared on the root
while it loaded.
"""

from __future__ import annotations

import contextlib
import importlib
import logging


def quietly(name: str):
    """`importlib.import_module(name)`, with the root logger's handlers as they were before."""
    root = logging.getLogger()
    before = list(root.handlers)
    module = importlib.import_module(name)
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
    return module


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def muted(logger: str, text: str):
    """Within the block, `logger`'s records containing `text` are dropped: a library's warning about
    what the caller chose (Orbax's 'Given directory is read only' when we open one to read it)."""
    drop = _Drop(text)
    log = logging.getLogger(logger)
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)
