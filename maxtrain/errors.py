"""The user error every layer raises (`ConfigError`: one `maxtrain: error:` line, exit 2) and its
did-you-mean, in a leaf module so the lowest layers (kernels, targets) need not import the config."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A user error in config or input: reported as one `maxtrain: error:` line, exit 2.
    `messages`: the problems it reports (several when a config has more than one)."""

    def __init__(self, message: str, messages: list[str] | None = None):
        super().__init__(message)
        self.messages = messages or [message]


def did_you_mean(value: str, choices) -> str:
    """`"did you mean X? "` for the closest choice, or ``""``."""
    close = difflib.get_close_matches(value, list(choices), n=1)
    return f"did you mean {close[0]}? " if close else ""
