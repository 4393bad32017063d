"""The limits Python states (fusedllm._limits: the plain path's checks, the
modules' constructors, rope table reading) are the C++ operators' limits:
each op is called at and across each boundary, compiled and plain, and both
must accept the same values and refuse the same ones with the same words."""

import pytest
import torch

from fusedllm import _limits, _plain

ops = torch.ops.fusedllm
OTHER_DTYPES = (torch.int32, torch.int64, torch.bool, torch.complex64)


def outcome(call):
    """None when ``call`` runs, else its ValueError's message."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def assert_agree(make_call, value, accepted):
    compiled, plain = outcome(make_call(ops, value)), outcome(make_call(_plain, value))
    assert compiled == plain, value
    assert (compiled is None) == accepted, (value, compiled)


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


DTYPE_CALLS = {
    "rms_norm": lambda impl, dt: lambda: impl.rms_norm(_t(2, 8, dtype=dt), None, 1e-6, 0.0, "llama"),
    "fused_add_rms_norm": lambda impl, dt: lambda: impl.fused_add_rms_norm(
        _t(2, 8, dtype=dt), _t(2, 8, dtype=dt), None, 1e-6, 0.0, "llama"),
    "swiglu": lambda impl, dt: lambda: impl.swiglu(_t(2, 8, dtype=dt), _t(2, 8, dtype=dt), "silu"),
    "swiglu_packed": lambda impl, dt: lambda: impl.swiglu_packed(_t(2, 8, dtype=dt), "silu"),
    "rope": lambda impl, dt: lambda: impl.rope(_t(1, 2, 3, 8, dtype=dt), _t(1, 1, 3, 8, dtype=dt),
                                               _t(4, 4), _t(4, 4), None, 0, False, -1, False),
    "attention": lambda impl, dt: lambda: impl.attention(_t(1, 2, 3, 8, dtype=dt), _t(1, 1, 3, 8, dtype=dt),
                                                         _t(1, 1, 3, 8, dtype=dt), None, 1.0, False, -1,
                                                         0.0, None),
    "attention mask": lambda impl, dt: lambda: impl.attention(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(1, 1, 3, 8),
                                                              _t(3, 3, dtype=dt), 1.0, False, -1, 0.0, None),
    "linear_cross_entropy": lambda impl, dt: lambda: impl.linear_cross_entropy(
        _t(3, 8, dtype=dt), _t(5, 8, dtype=dt), None, torch.tensor([0, 4, -100]), -100, "mean", 0.0,
        0.0, 0.0),
}


def _cross_entropy(impl, reduction="mean", label_smoothing=0.0, softcap=0.0, z_loss=0.0):
    return lambda: impl.linear_cross_entropy(_t(3, 8), _t(5, 8), None, torch.tensor([0, 4, -100]), -100,
                                             reduction, label_smoothing, softcap, z_loss)


@pytest.mark.parametrize("reduction", _limits.REDUCTIONS + ("avg", "Mean", ""))
def test_reductions(reduction):
    assert_agree(lambda impl, r: _cross_entropy(impl, reduction=r), reduction,
                 reduction in _limits.REDUCTIONS)


@pytest.mark.parametrize("name,value,accepted", [
    ("label_smoothing", 0.0, True), ("label_smoothing", 1.0, True), ("label_smoothing", -0.1, False),
    ("label_smoothing", 1.5, False), ("softcap", 0.0, True), ("softcap", 30.0, True),
    ("softcap", -1.0, False), ("softcap", float("inf"), False), ("z_loss", 0.0, True),
    ("z_loss", 1e-4, True), ("z_loss", -1e-4, False), ("z_loss", float("nan"), False)])
def test_cross_entropy_numbers(name, value, accepted):
    assert_agree(lambda impl, v: _cross_entropy(impl, **{name: v}), value, accepted)


@pytest.mark.parametrize("op", DTYPE_CALLS)
@pytest.mark.parametrize("dtype", _limits.FLOAT_DTYPES + OTHER_DTYPES, ids=str)
def test_float_dtypes(op, dtype):
    accepted = dtype in _limits.FLOAT_DTYPES or (op == "attention mask" and dtype == torch.bool)
    assert_agree(DTYPE_CALLS[op], dtype, accepted)


@pytest.mark.parametrize("casting", _limits.CASTINGS + ("t5", "Llama", ""))
def test_castings(casting):
    assert_agree(lambda impl, c: lambda: impl.rms_norm(_t(2, 8), _t(8), 1e-6, 0.0, c), casting,
                 casting in _limits.CASTINGS)
    assert_agree(lambda impl, c: lambda: impl.fused_add_rms_norm(_t(2, 8), _t(2, 8), _t(8), 1e-6, 0.0, c),
                 casting, casting in _limits.CASTINGS)


@pytest.mark.parametrize("activation", _limits.ACTIVATIONS + ("relu", "gelu", "swish"))
def test_activations(activation):
    accepted = activation in _limits.ACTIVATIONS
    assert_agree(lambda impl, a: lambda: impl.swiglu(_t(2, 8), _t(2, 8), a), activation, accepted)
    assert_agree(lambda impl, a: lambda: impl.swiglu_packed(_t(2, 8), a), activation, accepted)


@pytest.mark.parametrize("head_dim", [0, 1, _limits.MAX_HEAD_DIM, _limits.MAX_HEAD_DIM + 1])
def test_attention_head_dim(head_dim):
    assert_agree(lambda impl, d: lambda: impl.attention(_t(1, 2, 2, d), _t(1, 1, 2, d), _t(1, 1, 2, d), None,
                                                        1.0, True, -1, 0.0, None),
                 head_dim, 1 <= head_dim <= _limits.MAX_HEAD_DIM)


@pytest.mark.parametrize("rotary_dim", [-2, 0, 2, 7, 8, 10, -1])
def test_rotary_dim(rotary_dim):
    width = 4 if rotary_dim in (-1, 10) else max(rotary_dim, 0) // 2  # a table fitting the value
    accepted = rotary_dim == -1 or (0 < rotary_dim <= 8 and rotary_dim % 2 == 0)
    assert_agree(lambda impl, r: lambda: impl.rope(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(4, width), _t(4, width),
                                                   None, 0, False, r, False), rotary_dim, accepted)
    if rotary_dim != -1:  # and the Python rule, used before the op to read the tables
        message = outcome(lambda: _limits.check_rotary_dim("fusedllm.rope", rotary_dim, 8))
        assert message == outcome(lambda: ops.rope(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(4, width), _t(4, width),
                                                   None, 0, False, rotary_dim, False))


@pytest.mark.parametrize("positions", [[0, 1, 3], [0, 1, 4], [-1, 0, 1]])
def test_position_ids_in_the_table(positions):
    """The CPU op checks every position against the table (a GPU kernel asserts)."""
    assert_agree(lambda impl, p: lambda: impl.rope(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(4, 4), _t(4, 4),
                                                   torch.tensor(p), 0, False, -1, False),
                 positions, max(positions) < 4 and min(positions) >= 0)


def test_gpt_oss_defaults_are_the_schemas():
    """moe_experts' default alpha and limit: written once in C++ (into the op
    schemas) and once in Python (fusedllm._limits), the same values."""
    for name in ("moe_experts", "moe_experts_backward"):
        defaults = {a.name: a.default_value for a in getattr(ops, name).default._schema.arguments}
        assert (defaults["alpha"], defaults["limit"]) == (_limits.GPT_OSS_ALPHA, _limits.GPT_OSS_LIMIT), name
