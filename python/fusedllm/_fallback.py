"""Former name of :mod:`fusedllm._plain`, kept for code that imports it."""

from ._plain import *  # noqa: F401,F403
