"""How fusedllm's ops run on DTensors (``torch.distributed.tensor``): for each
op, the placements of its inputs under which every rank computes on its own
shard, and the placements of its outputs then. DTensor redistributes an
input placed otherwise to the cheapest of these (an all-gather, say) before
the op runs; what no redistribution can make right is refused with an error
that names the placement. docs/distributed.md has the table.

Registered with DTensor when fusedllm is imported after
``torch.distributed.tensor``, or else by the first op called on a DTensor
(importing DTensor costs a second, which plain users should not pay).
Placements are written for one mesh dimension; DTensor expands them to every
dimension of the mesh.
"""

from __future__ import annotations

import sys

import torch

from ._extension import has_extension

_registered = False

# op name -> its strategies: filled by the op modules (fusedllm/ops/*.py) through rule()
RULES = {}

# Filled by register(): DTensor's placement and spec types.
Replicate = Shard = Partial = DTensorSpec = None


# The placements the op modules' rules build (the rules run only after register()).
def replicate():
    return Replicate()


def shard(dim: int):
    return Shard(dim)


def partial():
    return Partial()


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor, without importing DTensor (which costs a second)."""
    return type(t).__name__ == "DTensor"


def needs_registering(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor and the rules are not yet registered."""
    return not _registered and is_dtensor(t)


def register() -> None:
    global _registered, Replicate, Shard, Partial, DTensorSpec
    if _registered or not torch.distributed.is_available() or not has_extension():
        return  # without the extension the plain path runs, on DTensor's own rules
    from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: F811
    from torch.distributed.tensor._dtensor_spec import DTensorSpec  # noqa: F811
    from torch.distributed.tensor.experimental import register_sharding

    ops = torch.ops.fusedllm
    for name, strategies in RULES.items():
        register_sharding(getattr(ops, name).default)(strategies)
    _registered = True


def rule(name: str):
    """Decorator: op ``name``'s sharding strategy, as DTensor's register_sharding
    takes it (the op's arguments in; a list of (output placements, input placements) out)."""

    def add(strategies):
        RULES[name] = strategies
        return strategies

    return add


def register_if_imported() -> None:
    if "torch.distributed.tensor" in sys.modules:
        register()


# --- helpers ---------------------------------------------------------------------------------


def _on(spec, placement):
    """``placement`` for a DTensor argument, None for anything else (None, a number)."""
    return placement if isinstance(spec, DTensorSpec) else None


def _rows(spec, keep_last: int = 1) -> range:
    """The dims of ``spec`` one may shard without splitting what the op reduces
    over or pairs up (its last ``keep_last`` dims)."""
    return range(max(0, len(spec.shape) - keep_last))


def _placement_on(spec, dim: int, size: int):
    """Shard(dim) where ``spec`` holds ``size`` entries along ``dim``; Replicate
    where that dim is broadcast (size 1) or absent (dim < 0)."""
    if dim < 0 or spec.shape[dim] == 1 and size != 1:
        return Replicate()
    return Shard(dim)


def _mesh_size(spec) -> int:
    return spec.mesh.size()


def _refuse(op: str, what: str) -> None:
    # DTensor reports it as a RuntimeError that quotes this message first
    raise ValueError(f"fusedllm.{op} on DTensors: {what}")


def _pinned(op: str, names: tuple[str, ...], specs: tuple, strategies: list) -> list:
    """Of ``strategies``, those that leave the tensors an in-place op writes
    (``specs``, at input positions named by ``names``) where they are: DTensor
    would otherwise write a redistributed copy and leave the caller's tensor as
    it was. Refused when none does."""
    current = [s.placements for s in specs]
    offered = {tuple(strategy[i] for i in positions) for strategy, positions in strategies}
    for mesh_dim in range(len(current[0])):
        if tuple(c[mesh_dim] for c in current) not in offered:
            placed = ", ".join(f"{n} {c}" for n, c in zip(names, current))
            _refuse(op, f"writes its arguments in place, and cannot on these placements ({placed}); "
                        f"each must be replicated or sharded alike over a dim the op does not "
                        f"reduce over")
    return [strategy for strategy, positions in strategies
            if any(tuple(strategy[i] for i in positions) == tuple(c[d] for c in current)
                   for d in range(len(current[0])))]
