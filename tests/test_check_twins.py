"""Each argument check of the C++ operators (csrc/include/fusedllm/*_op.h,
checks.h, autograd.h) has a word-for-word twin on the plain path (the op's
module in fusedllm/ops/, fusedllm._checks, fusedllm._limits). One table drives bad
(and a few good) inputs through both, ``torch.ops.fusedllm.X(*args)`` and
``fusedllm._plain.X(*args)``: both must accept, or both refuse with the same
exception type and the same message, and the compiled message must be the one
the row states. A coverage test runs the rows' plain calls and requires
every refusal the plain twins can reach in those modules to be reached,
except those listed in UNREACHABLE with the reason.

The rows are the bad inputs of tests/op_table.py (``row(op, name, build, expect)``).
CPU tensors only: the compiled side runs its CPU kernels."""

from __future__ import annotations

import ast
import inspect
import os
import re
import traceback
from typing import NamedTuple

import pytest
import torch

import fusedllm  # noqa: F401  (loads the extension: torch.ops.fusedllm)
from fusedllm import _checks, _limits, _plain, ops as op_modules

from op_table import ATTENTION_ARGS, CASES

ops = torch.ops.fusedllm


# --- the refusals no CPU-only table can reach -----------------------------------------------------
# (module file, function, words of the message) -> why
DEVICE = "a device mismatch: every tensor here is a CPU tensor (a meta tensor sends the op to its fake kernel)"
UNREACHABLE = {
    ("_checks.py", "_check_same", "is on"): DEVICE,
    ("rope.py", "_check_rope", "cos and sin must be on"): DEVICE,
    ("rope.py", "_check_rope", "position_ids is on"): DEVICE,
    ("attention.py", "_check_cu_seqlens", "is on"): DEVICE,
    ("attention.py", "check_attention", "sinks is on"): DEVICE,
    ("attention.py", "check_attention", "alibi_slopes is on"): DEVICE,
    ("attention.py", "check_attention", "mask is on"): DEVICE,
    ("attention.py", "check_attention", "head_dim must be at least 1"):
        "only with max_head_dim=None (fusedllm.attention_with_weights); the op keeps the kernels' limit",
    ("attention.py", "_check_kv_lens", "is on"): DEVICE,
    ("cross_entropy.py", "check_cross_entropy", "target is on"): DEVICE,
    ("moe.py", "check_moe_route", "correction_bias is on"): DEVICE,
    ("moe.py", "check_moe_experts", "indices is on"): DEVICE,
    ("moe.py", "check_moe_experts", "weights is on"): DEVICE,
    ("attention.py", "_check_kv_dtypes", "is on"): DEVICE,
    ("kv_quant.py", "_plain_quantize_kv", "is on"): DEVICE,
    ("_limits.py", "check_rotary_dim", "rotary_dim must be an int"):
        "the op's schema takes an int: a float is refused by the dispatcher (RuntimeError) before any check",
}


# --- the tests ------------------------------------------------------------------------------------

def _outcome(impl, case):
    """None when the call runs, else (exception type name, message, exception)."""
    args = case.build()
    try:
        getattr(impl, case.op)(*args)
    except Exception as error:  # noqa: BLE001 - any exception is an outcome to compare
        return type(error).__name__, str(error), error
    return None


def _short(outcome):
    return None if outcome is None else outcome[:2]


def _name(case):
    """The name the case's errors carry: a call of the attention op with packed
    sequences is what fusedllm.attention_varlen makes, and answers as it."""
    if case.op == "attention":
        args = dict(zip(ATTENTION_ARGS, case.build()[3:]))
        if args["cu_seqlens_q"] is not None or args["cu_seqlens_k"] is not None:
            return "attention_varlen"
    return case.op


def _whole(case, message):
    return message if message.startswith("fusedllm.") else f"fusedllm.{_name(case)}: {message}"


def _tabled_plain(case):
    if case.plain is None or isinstance(case.plain, tuple):
        return case.plain
    return "ValueError", _whole(case, case.plain)


def _param(case):
    marks = [pytest.mark.xfail(strict=True, reason=case.why)] if case.why else []
    return pytest.param(case, id=case.id, marks=marks)


def _ops_of_both():
    registered = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("fusedllm::")}
    return registered & set(_plain.OPS)


def test_table_covers_every_op_of_both():
    both = _ops_of_both()
    assert {"rms_norm", "fused_add_rms_norm", "swiglu", "swiglu_packed", "rope", "rope_", "attention",
            "quantize_kv", "linear_cross_entropy", "moe_route", "moe_experts"} <= both, both
    tabled = {case.op for case in CASES}
    assert tabled == both
    for op in both:
        rows = [case for case in CASES if case.op == op]
        assert any(case.expect is None for case in rows), f"{op}: no call both accept"
        assert any(case.expect is not None for case in rows), f"{op}: no bad input"
    assert len({case.id for case in CASES}) == len(CASES), "case ids must be unique"


@pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in CASES])
def test_compiled_outcome_is_as_tabled(case):
    """The compiled op does what the row says; for a row where the two disagree, the
    plain path still does what the row says it does today (so the xfail is this one)."""
    got = _short(_outcome(ops, case))
    if case.expect is None:
        assert got is None, got
    else:
        assert got is not None and got[0] == "ValueError", got
        if isinstance(case.expect, re.Pattern):
            prefix = f"fusedllm.{_name(case)}: "
            assert got[1].startswith(prefix) and case.expect.fullmatch(got[1][len(prefix):]), got[1]
        else:
            assert got[1] == _whole(case, case.expect)
    if case.why:
        assert _short(_outcome(_plain, case)) == _tabled_plain(case)


@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_twins_agree(case):
    """Both accept, or both raise the same exception type with the same message."""
    assert _short(_outcome(_plain, case)) == _short(_outcome(ops, case))


# --- every refusal of the plain path is reached ---------------------------------------------------

def _path(module):
    return os.path.realpath(inspect.getsourcefile(module))


MODULES = {_path(m): m for m in (_checks, _limits, *op_modules.MODULES)}


class Site(NamedTuple):
    file: str  # base name
    function: str
    first: int
    last: int
    text: str  # the message's source


def _plain_path():
    """The functions of the plain path: the twins (fusedllm._plain.OPS) and what they call,
    by name, in MODULES, with the functions nested in them; as {path: [FunctionDef]}, each
    module's in ast.walk's order (breadth first: a nested function after its parent)."""
    trees = {}
    for path in MODULES:
        with open(path) as f:
            trees[path] = ast.parse(f.read())
    functions = {path: [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
                 for path, tree in trees.items()}
    top = {path: {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
           for path, tree in trees.items()}

    def defs(path, name):  # the module's own function, else every module's of that name (imported)
        if name in top[path]:
            return [(path, top[path][name])]
        return [(p, named[name]) for p, named in top.items() if name in named]

    roots = [(_path(inspect.getmodule(twin.__wrapped__)), twin.__wrapped__.__name__) for twin in _plain.OPS.values()]
    todo = [(path, top[path][name]) for path, name in roots]
    seen = set()
    while todo:
        path, function = todo.pop()
        if (path, function) in seen:
            continue
        seen.add((path, function))
        for node in ast.walk(function):
            if isinstance(node, ast.FunctionDef) and node is not function:
                seen.add((path, node))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                todo += defs(path, node.func.id)
    return {path: [f for f in functions[path] if (path, f) in seen] for path in MODULES}


def _sites():
    """Every call of _fail and every raise on the plain path (but _fail's own raise)."""
    sites = {}
    for path, functions in _plain_path().items():
        for function in functions:
            if function.name == "_fail":
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_fail":
                    message = node.args[1]
                elif isinstance(node, ast.Raise):
                    message = node.exc.args[0] if isinstance(node.exc, ast.Call) and node.exc.args else node.exc
                else:
                    continue
                sites[(path, node.lineno)] = Site(os.path.basename(path), function.name, node.lineno,
                                                  node.end_lineno, ast.unparse(message))
    return sites


def _site_of(error, sites):
    """The refusal that raised ``error``: the innermost frame in the plain path's modules
    (the caller of _fail when _fail raised)."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = os.path.realpath(frame.filename)
        if path not in MODULES or (frame.name == "_fail" and path == _path(_checks)):
            continue
        for (site_path, _), site in sites.items():
            if site_path == path and site.first <= frame.lineno <= site.last:
                return site
        return None
    return None


def _unreachable(site):
    return next((why for (file, function, words), why in UNREACHABLE.items()
                 if (file, function) == (site.file, site.function) and words in site.text), None)


def test_every_refusal_of_the_plain_path_is_reached():
    sites = _sites()
    assert len(sites) > 100, len(sites)  # the parse found them
    reached = {}
    for case in CASES:
        outcome = _outcome(_plain, case)
        if outcome is not None and outcome[0] == "ValueError":
            site = _site_of(outcome[2], sites)
            assert site is not None, (case.id, outcome[1])
            reached.setdefault(site, []).append(case.id)
    for key in UNREACHABLE:  # every entry names a refusal that exists
        assert any(_unreachable(site) and (site.file, site.function) == key[:2] and key[2] in site.text
                   for site in sites.values()), key
    listed = {site for site in sites.values() if _unreachable(site)}
    wrongly_listed = {f"{s.file}:{s.first} {s.function}: {s.text}": reached[s] for s in listed & set(reached)}
    assert not wrongly_listed, f"reached, yet listed in UNREACHABLE: {wrongly_listed}"
    missed = [f"{s.file}:{s.first} {s.function}: {s.text}" for s in sites.values()
              if s not in reached and s not in listed]
    assert not missed, "refusals no row reaches:\n" + "\n".join(missed)
