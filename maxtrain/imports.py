"""Imports of libraries that log through absl while they load (Orbax, grain).

absl calls `logging.basicConfig()` whenever it logs and the root logger has no handler yet, so
importing such a library leaves a root handler behind, after which an application's own
`logging.basicConfig(level=...)` does nothing. A library leaves the root logger to the
application: `quietly` imports a module and removes the handlers that appeared on the root
while it loaded.
"""

from __future__ import annotations

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
