"""``env_var``: an environment variable set for the calls inside a block."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def env_var(name: str, value: str | None):
    """os.environ[name] = value inside the block (None: as it is), restored after."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
