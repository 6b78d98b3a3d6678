"""A new output directory written all at once (`maxtrain prepare`, `maxtrain convert`)."""

from __future__ import annotations

import contextlib
import os
import shutil

from maxtrain.config import ConfigError


@contextlib.contextmanager
def building(out_dir: str, flag: str = "output"):
    """Yields `OUT.partial-PID` beside `out_dir`, renamed to `out_dir` (onto nothing or an empty
    directory) when the body completes and removed when it fails: an output is complete or absent.
    That `out_dir` is new or empty is the caller's check, made before any expensive work."""
    target = os.path.realpath(out_dir)  # an empty directory reached through a link is filled, not replaced
    partial = f"{target}.partial-{os.getpid()}"
    try:
        os.makedirs(partial)
    except OSError as e:
        raise ConfigError(f"{flag} {out_dir} cannot be created: {e.strerror}; choose a writable location") from None
    try:
        yield partial
        try:
            os.replace(partial, target)
        except OSError as e:
            raise ConfigError(f"{flag} {out_dir} could not be put in place ({e.strerror}); "
                              "did something else write there meanwhile?") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
