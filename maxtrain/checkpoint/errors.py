"""How a checkpoint's failures are named: `CorruptCheckpoint`, and any error as one short line."""

from __future__ import annotations

import os
import re


class CorruptCheckpoint(Exception):
    """A checkpoint that is partial, unreadable or fails its checksums."""


def one_line(e: BaseException) -> str:
    """`e` as one line of at most ~300 characters that keeps TensorStore's OS error text."""
    text = str(e).strip().splitlines()
    first = (text[0] if text else "").split(" See full TensorStore details")[0]  # then a repr of the spec
    line = f"{type(e).__name__}: {first}"
    short = line if len(line) <= 300 else f"{line[:140]} ... {line[-150:]}"  # the cause is often at the end
    code = re.search(r"\[os_error_code='?(\d+)'?\]", first)  # TensorStore's OS error, anywhere in the line
    cause = os.strerror(int(code.group(1))) if code else ""  # its text may sit inside the cut, or
    if cause and cause not in short:  # before a repr of the spec that sits between it and the code
        short += f" (cause: {cause})"
    return short
