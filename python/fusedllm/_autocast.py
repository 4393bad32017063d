"""What the fusedllm operators do under ``torch.autocast``: each op's rule is
given beside the op (:func:`rule` in fusedllm/ops/*.py); the table and the
reasons are in docs/mixed-precision.md.

Each rule is registered as a kernel at the ``AutocastCPU`` / ``AutocastCUDA``
dispatch keys of ``torch.ops.fusedllm`` (above autograd, so the casts are
differentiable and torch.compile traces them as ordinary ops), and applied by
:func:`plain` to the plain-PyTorch path, which then runs with autocast off so
that it computes what the kernels compute. Ops without a rule fall through:
autocast leaves them alone, as it leaves the elementwise ops they replace.
"""

from __future__ import annotations

import functools
import inspect

import torch

# "lower": the autocast dtype (torch.get_autocast_dtype); "float32": float32.
LOWER, FLOAT32 = "lower", "float32"

# op -> {device type: (policy, the arguments it casts, {output index: the
# arguments whose promoted dtype it is given back})}, filled by the op modules
# (fusedllm/ops/*.py) through rule(). The last is for fused_add_rms_norm's
# h = input + residual, which keeps the dtype of that add (autocast leaves an
# add alone) while the normalized output is float32.
RULES = {}


def rule(name: str, **by_device) -> None:
    """Op ``name``'s rule per device type (``cpu=``, ``cuda=``)."""
    RULES[name] = by_device


# Only these are cast: float64 stays (as autocast leaves it), and so do int8
# and float8 codes of a quantized KV cache.
_CASTABLE = (torch.float32, torch.bfloat16, torch.float16)


def _target(policy: str, device_type: str) -> torch.dtype:
    return torch.get_autocast_dtype(device_type) if policy == LOWER else torch.float32


def _cast(value, device_type: str, dtype: torch.dtype):
    if (isinstance(value, torch.Tensor) and value.dtype in _CASTABLE and value.dtype != dtype
            and value.device.type == device_type):
        return value.to(dtype)
    return value


def _arg(params, args, kwargs, name):
    i = params.index(name)
    return args[i] if i < len(args) else kwargs.get(name)


def _cast_args(params, rule, device_type, args, kwargs):
    """``(args, kwargs, restore)``: the rule's arguments cast (``params``: the
    op's argument names), and the dtypes to give outputs back by index."""
    policy, names, *given_back = rule
    restore = {}
    for index, sources in (given_back[0] if given_back else {}).items():
        dtypes = [t.dtype for t in (_arg(params, args, kwargs, n) for n in sources) if isinstance(t, torch.Tensor)]
        restore[index] = functools.reduce(torch.promote_types, dtypes)
    dtype = _target(policy, device_type)
    args = list(args)
    for name in names:
        i = params.index(name)
        if i < len(args):
            args[i] = _cast(args[i], device_type, dtype)
        elif name in kwargs:
            kwargs = {**kwargs, name: _cast(kwargs[name], device_type, dtype)}
    return args, kwargs, restore


def _restore(outs, restore):
    if not restore:
        return outs
    return type(outs)(o.to(restore[i]) if i in restore else o for i, o in enumerate(outs))


def casts_to_float32(name: str, x: torch.Tensor) -> bool:
    """Whether op ``name`` casts ``x`` to float32 under the autocast now active
    (the norms on CUDA): the op then takes any mix of float dtypes itself."""
    device_type = x.device.type
    rule = RULES.get(name, {}).get(device_type if device_type == "cpu" else "cuda")  # as plain() reads them
    return (rule is not None and rule[0] == FLOAT32 and x.dtype in _CASTABLE
            and _autocast_enabled(device_type))


def _autocast_enabled(device_type: str) -> bool:
    # torch.compile traces is_autocast_enabled but not _is_autocast_available: asked only off CPU and CUDA
    if device_type not in _AUTOCAST_KEYS and not torch._C._is_autocast_available(device_type):
        return False
    return torch.is_autocast_enabled(device_type)


_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
_libraries = []  # the registrations live as long as these


def register(ns: str = "fusedllm") -> None:
    """Registers RULES at the autocast keys of library ``ns``."""
    lib = torch.library.Library(ns, "IMPL")
    _libraries.append(lib)
    for name, by_device in RULES.items():
        op = getattr(getattr(torch.ops, ns), name).default
        params = [a.name for a in op._schema.arguments]
        for device_type, op_rule in by_device.items():
            lib.impl(name, _autocast_kernel(op, params, op_rule, device_type), _AUTOCAST_KEYS[device_type],
                     with_keyset=True)


def _autocast_kernel(op, params, rule, device_type):
    key = getattr(torch._C.DispatchKey, _AUTOCAST_KEYS[device_type])

    def kernel(_keyset, *args, **kwargs):
        args, kwargs, restore = _cast_args(params, rule, device_type, args, kwargs)
        # Below this key only: the op's own kernels run on the cast arguments.
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            outs = op(*args, **kwargs)
        return _restore(outs, restore)

    return kernel


def plain(name: str):
    """Decorator for a plain-path op: under autocast on its tensors' device it
    casts as RULES say, then runs with autocast off (as the kernels do).
    Accelerators other than CUDA (the plain path is what runs there) take
    CUDA's rules, as torch's autocast lists for them mostly follow CUDA's."""

    def wrap(fn):
        params = list(inspect.signature(fn).parameters)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            device_type = first.device.type if first is not None else "cpu"
            if not _autocast_enabled(device_type):
                return fn(*args, **kwargs)
            by_device = RULES.get(name, {})
            op_rule = by_device.get(device_type if device_type == "cpu" else "cuda")
            restore = {}
            if op_rule is not None:
                args, kwargs, restore = _cast_args(params, op_rule, device_type, args, kwargs)
            with torch.autocast(device_type, enabled=False):
                return _restore(fn(*args, **kwargs), restore)

        return run

    return wrap
