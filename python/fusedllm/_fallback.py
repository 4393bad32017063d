"""Former name of :mod:`fusedllm._plain`, kept for code that imports it."""

from ._plain import *  # noqa: F401,F403
from ._plain import attention, dropout_keep, philox_words  # noqa: F401
