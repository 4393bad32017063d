"""Each public op's sample inputs, in one table (PyTorch's OpInfo as the model).

tests/test_op_table.py runs every sample through the checks every op owes:
``torch.library.opcheck`` of each operator the sample reaches, forward and
backward (found by running it, so a new backward op is checked without being
listed); ``gradcheck`` in float64; ``torch.compile(fullgraph=True)`` against
eager; the second-derivative contract; and, for samples marked ``variants``,
the gradcheck again under every compiled CPU variant (test_cpu_variants.py).
Below them, each operator's bad (and a few good) inputs, by the operator's
name: tests/test_check_twins.py runs each through the compiled operator and
its plain twin and compares both with the exact message.

Adding an op: an Entry with its samples, and its rows. A sample builds its
tensors for a dtype and device, and runs the public function on them;
``grad`` names the tensors the function is differentiable in. A row builds an
operator's arguments and states the message it must refuse them with."""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

import torch

import fusedllm

OPCHECK, GRADCHECK, COMPILE = "opcheck", "gradcheck", "compile"
DEVICES = ("cpu", "simt", "cuda")  # simt: both emulator schedules


class Sample(NamedTuple):
    id: str
    build: Callable[[torch.dtype, str], tuple]  # (floating dtype, device) -> the tensors run takes
    run: Callable[..., object]  # run(*tensors) -> a tensor or a tuple of tensors
    grad: tuple[int, ...] = ()  # positions of the tensors run is differentiable in
    dtype: torch.dtype = torch.float32  # opcheck's and compile's (gradcheck builds float64)
    checks: frozenset = frozenset({OPCHECK, GRADCHECK})
    devices: tuple[str, ...] = DEVICES
    variants: bool = False  # its gradcheck re-runs under every compiled CPU variant
    env: tuple[tuple[str, str], ...] = ()  # environment settings while it runs


class Entry(NamedTuple):
    name: str  # fusedllm.<name>, or what the samples call
    ops: tuple[str, ...]  # the torch.ops.fusedllm operators its samples must reach
    second: str | None  # second derivatives: "refused", "through" (RoPE: its backward is RoPE), None: no backward
    samples: tuple[Sample, ...]


def sample(id, build, run, grad=(), *checks, **options):
    return Sample(id, build, run, tuple(grad), checks=frozenset(checks or (OPCHECK, GRADCHECK)), **options)


def T(dtype, device, *shape, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


def I32(values, device):  # noqa: N802
    return torch.tensor(values, dtype=torch.int32, device=device)


# --- RMSNorm --------------------------------------------------------------------------------------

def _rms_samples():
    out = []
    for casting, offset, with_weight in [("llama", 0.0, True), ("gemma", 0.0, True), ("llama", 1.0, True),
                                         ("gemma", 1.0, True), ("llama", 0.0, False)]:
        name = f"{casting}-offset{offset:g}" + ("" if with_weight else "-no_weight")
        checks = (OPCHECK, GRADCHECK, COMPILE) if (casting, offset) == ("gemma", 1.0) else ()
        if with_weight:
            out.append(sample(name, lambda dt, dev: (T(dt, dev, 3, 5, 11), T(dt, dev, 11)),
                              lambda x, w, c=casting, o=offset: fusedllm.rms_norm(x, w, 1e-6, o, c), (0, 1),
                              *checks, variants=True))
        else:
            out.append(sample(name, lambda dt, dev: (T(dt, dev, 3, 5, 11),),
                              lambda x, c=casting: fusedllm.rms_norm(x, None, 1e-6, 0.0, c), (0,), variants=True))
    out.append(sample("bfloat16-gemma", lambda dt, dev: (T(dt, dev, 3, 5), T(dt, dev, 5)),
                      lambda x, w: fusedllm.rms_norm(x, w, 1e-5, 1.0, "gemma"), (0, 1), OPCHECK,
                      dtype=torch.bfloat16))
    return tuple(out)


def _add_rms_samples():
    out = []
    for casting, offset, with_weight in [("llama", 0.0, True), ("gemma", 1.0, True), ("llama", 0.0, False)]:
        name = f"{casting}-offset{offset:g}" + ("" if with_weight else "-no_weight")
        three = lambda dt, dev: (T(dt, dev, 3, 5, 11), T(dt, dev, 3, 5, 11), T(dt, dev, 11))  # noqa: E731
        two = lambda dt, dev: (T(dt, dev, 3, 5, 11), T(dt, dev, 3, 5, 11))  # noqa: E731
        out.append(sample(
            name, three if with_weight else two,
            lambda x, r, w=None, c=casting, o=offset: fusedllm.fused_add_rms_norm(x, r, w, 1e-6, o, c),
            (0, 1, 2) if with_weight else (0, 1), *((OPCHECK, GRADCHECK, COMPILE) if offset else ()), variants=True))
    return tuple(out)


# --- SwiGLU ---------------------------------------------------------------------------------------

def _swiglu_samples():
    out = []
    for activation in ("silu", "gelu_tanh"):
        out.append(sample(f"split-{activation}", lambda dt, dev: (T(dt, dev, 3, 4, 9), T(dt, dev, 3, 4, 9)),
                          lambda g, u, a=activation: fusedllm.swiglu(g, u, a), (0, 1), OPCHECK, GRADCHECK, COMPILE,
                          variants=True))
        out.append(sample(f"packed-{activation}", lambda dt, dev: (T(dt, dev, 3, 4, 18),),
                          lambda p, a=activation: fusedllm.swiglu(p, activation=a), (0,), OPCHECK, GRADCHECK, COMPILE,
                          variants=True))
    return tuple(out)


# --- RoPE -----------------------------------------------------------------------------------------

def _tables(dev, rotary_dim, positions):
    return fusedllm.rope_tables(rotary_dim, positions, device=dev)


def _rope_samples():
    qk = lambda dt, dev, rd, n, d=8: (T(dt, dev, 2, 4, 5, d), T(dt, dev, 2, 2, 5, d), *_tables(dev, rd, n))  # noqa: E731
    out = []
    for interleaved in (False, True):
        out.append(sample(
            "partial-offset" + ("-interleaved" if interleaved else ""), lambda dt, dev: qk(dt, dev, 6, 16),
            lambda q, k, cos, sin, i=interleaved: fusedllm.apply_rope(q, k, cos, sin, offset=4, interleaved=i,
                                                                      rotary_dim=6),
            (0, 1), OPCHECK, GRADCHECK, COMPILE, variants=True))
    out.append(sample(
        "positions-interleaved", lambda dt, dev: (*qk(dt, dev, 8, 16, 16), torch.tensor([[0, 2, 4, 6, 8]] * 2,
                                                                                       device=dev)),
        lambda q, k, cos, sin, pos: fusedllm.apply_rope(q, k, cos, sin, position_ids=pos, interleaved=True,
                                                        rotary_dim=8), (0, 1), OPCHECK, GRADCHECK, COMPILE))
    out.append(sample(
        "per_token_tables", lambda dt, dev: (lambda q, k, cos, sin: (q, k, cos[None, :5], sin[None, :5]))(
            *qk(dt, dev, 8, 16)),
        lambda q, k, cos, sin: fusedllm.apply_rope(q, k, cos, sin, rotary_dim=8), (0, 1)))
    out.append(sample(
        "in_place", lambda dt, dev: qk(dt, dev, 8, 16),
        lambda q, k, cos, sin: fusedllm.apply_rope(q.clone(), k.clone(), cos, sin, offset=1, inplace=True),
        (), OPCHECK))
    return tuple(out)


# --- attention ------------------------------------------------------------------------------------

def _qkv(dt, dev, b, hq, hkv, sq, sk, d):
    return T(dt, dev, b, hq, sq, d), T(dt, dev, b, hkv, sk, d), T(dt, dev, b, hkv, sk, d)


def _slopes(dt, dev, hq, batch=None):
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)], dtype=torch.float64)
    if batch is not None:  # rows that differ, so that a kernel reading the wrong one differs
        slopes = slopes * torch.linspace(2.0, 0.5, batch, dtype=torch.float64).unsqueeze(1)
    return slopes.to(dtype=dt if dt == torch.float64 else torch.float32, device=dev)


def _sinks(dt, dev, hq):
    return (2.0 + torch.randn(hq, dtype=torch.float64)).to(dtype=dt if dt == torch.float64 else torch.float32,
                                                           device=dev)


def _attention_samples():
    out = []
    for causal, window in [(False, None), (True, None), (True, 3), (False, 2)]:
        name = ("causal" if causal else "full") + ("" if window is None else f"-window{window}")
        out.append(sample(name, lambda dt, dev: _qkv(dt, dev, 2, 4, 2, 5, 7, 8),
                          lambda q, k, v, c=causal, w=window: fusedllm.attention(q, k, v, causal=c, scale=0.7,
                                                                                 window=w),
                          (0, 1, 2), variants=True))
        out.append(sample(name + "-decoding_mqa", lambda dt, dev: _qkv(dt, dev, 1, 3, 1, 1, 6, 5),
                          lambda q, k, v, c=causal, w=window: fusedllm.attention(q, k, v, causal=c, window=w),
                          (0, 1, 2), variants=True))
    options = {  # (build of the extra tensors, keyword arguments from them)
        "softcap": (lambda dt, dev: (), lambda: dict(softcap=0.8, scale=0.9)),
        "sinks": (lambda dt, dev: (_sinks(dt, dev, 4),), lambda s: dict(sinks=s)),
        "alibi": (lambda dt, dev: (_slopes(dt, dev, 4),), lambda a: dict(alibi_slopes=a)),
        "alibi_per_batch": (lambda dt, dev: (_slopes(dt, dev, 4, 2),), lambda a: dict(alibi_slopes=a)),
        "window_left_right": (lambda dt, dev: (), lambda: dict(window=(2, 1))),
        "window_right_only": (lambda dt, dev: (), lambda: dict(window=(-1, 0))),
        "all": (lambda dt, dev: (_sinks(dt, dev, 4), _slopes(dt, dev, 4)),
                lambda s, a: dict(softcap=1.1, sinks=s, alibi_slopes=a, window=(3, 2))),
    }
    for option, (extra, kwargs) in options.items():
        differentiable = (0, 1, 2, 3) if option in ("sinks", "all") else (0, 1, 2)
        for causal in (False, True):
            out.append(sample(
                f"{option}-{'causal' if causal else 'full'}",
                lambda dt, dev, e=extra: (*_qkv(dt, dev, 2, 4, 2, 5, 7, 8), *e(dt, dev)),
                lambda q, k, v, *e, c=causal, kw=kwargs: fusedllm.attention(q, k, v, causal=c, **kw(*e)),
                differentiable, OPCHECK, GRADCHECK, *((COMPILE,) if causal else ()),
                variants=option == "all"))
    out += [
        sample("bfloat16-all", lambda dt, dev: (*_qkv(dt, dev, 2, 4, 2, 9, 11, 16), _sinks(dt, dev, 4),
                                               _slopes(dt, dev, 4)),
               lambda q, k, v, s, a: fusedllm.attention(q, k, v, causal=True, softcap=2.0, sinks=s, alibi_slopes=a,
                                                        window=(5, 1)),
               (0, 1, 2, 3), OPCHECK, dtype=torch.bfloat16),
        sample("padding_mask-dropout-all", lambda dt, dev: (*_qkv(dt, dev, 2, 4, 2, 9, 11, 16),
                                                           torch.rand(2, 1, 1, 11, device=dev) > 0.3,
                                                           _sinks(dt, dev, 4), _slopes(dt, dev, 4, 2)),
               lambda q, k, v, m, s, a: fusedllm.attention(q, k, v, causal=True, window=4, mask=m, dropout_p=0.2,
                                                           softcap=3.0, sinks=s, alibi_slopes=a),
               (0, 1, 2, 4), OPCHECK),
        sample("additive_mask-dropout-window", lambda dt, dev: (*_qkv(dt, dev, 2, 4, 2, 9, 11, 16),
                                                               T(dt, dev, 9, 11)),
               lambda q, k, v, m: fusedllm.attention(q, k, v, scale=0.25, window=3, mask=m, dropout_p=0.2),
               (0, 1, 2), OPCHECK),
        sample("padding_mask", lambda dt, dev: (*_qkv(dt, dev, 2, 4, 2, 5, 7, 8),
                                               torch.tensor([[True] * 7, [False] * 2 + [True] * 5],
                                                            device=dev).view(2, 1, 1, 7)),
               lambda q, k, v, m: fusedllm.attention(q, k, v, causal=True, mask=m), (0, 1, 2)),
        sample("additive_mask", lambda dt, dev: (*_qkv(dt, dev, 2, 4, 2, 5, 7, 8), T(dt, dev, 5, 7)),
               lambda q, k, v, m: fusedllm.attention(q, k, v, mask=m), (0, 1, 2)),
        sample("gqa-window6", lambda dt, dev: _qkv(dt, dev, 2, 4, 2, 13, 13, 16),
               lambda q, k, v: fusedllm.attention(q, k, v, causal=True, window=6), (0, 1, 2), COMPILE),
    ]
    return tuple(out)


def _pack(dt, dev, lens_q, lens_k, hq=4, hkv=2, d=6):
    cu = lambda lens: I32([0, *torch.tensor(lens).cumsum(0).tolist()], dev)  # noqa: E731
    return (T(dt, dev, sum(lens_q), hq, d), T(dt, dev, sum(lens_k), hkv, d), T(dt, dev, sum(lens_k), hkv, d),
            cu(lens_q), cu(lens_k))


def _varlen_samples():
    small = ([2, 0, 3, 1], [4, 2, 3, 0])
    cases = {  # (extra tensors, keyword arguments from them)
        "causal": (lambda dt, dev: (), lambda: dict(causal=True)),
        "window": (lambda dt, dev: (), lambda: dict(window=(7, 2))),
        "softcap": (lambda dt, dev: (), lambda: dict(softcap=1.5, scale=0.3)),
        "alibi_per_sequence": (lambda dt, dev: (_slopes(dt, dev, 4, 4),), lambda a: dict(causal=True, alibi_slopes=a)),
        "all": (lambda dt, dev: (_sinks(dt, dev, 4), _slopes(dt, dev, 4, 4)),
                lambda s, a: dict(causal=True, softcap=1.5, scale=0.3, sinks=s, alibi_slopes=a, window=(9, 0))),
        "all_noncausal": (lambda dt, dev: (_sinks(dt, dev, 4), _slopes(dt, dev, 4)),
                          lambda s, a: dict(softcap=1.5, scale=0.3, sinks=s, alibi_slopes=a, window=(9, 4))),
    }
    out = []
    for case, (extra, kwargs) in cases.items():
        sinks = case.startswith("all")
        out.append(sample(
            case, lambda dt, dev, e=extra: (*_pack(dt, dev, *small), *e(dt, dev)),
            lambda q, k, v, cq, ck, *e, kw=kwargs: fusedllm.attention_varlen(q, k, v, cq, ck, **kw(*e)),
            (0, 1, 2, 5) if sinks else (0, 1, 2), OPCHECK, GRADCHECK))
    longer = ([3, 17, 0, 8], [9, 17, 4, 2])
    for case in ("causal", "all"):
        extra, kwargs = cases[case]
        for given in (False, True):
            lengths = dict(max_seqlen_q=17, max_seqlen_k=17) if given else {}
            out.append(sample(
                f"{case}-{'given' if given else 'default'}_max_seqlen-d16",
                lambda dt, dev, e=extra: (*_pack(dt, dev, *longer, d=16), *e(dt, dev)),
                lambda q, k, v, cq, ck, *e, kw=kwargs, n=lengths: fusedllm.attention_varlen(q, k, v, cq, ck, **n,
                                                                                          **kw(*e)),
                (0, 1, 2, 5) if case == "all" else (0, 1, 2), COMPILE))
    out.append(sample("three_sequences-d16", lambda dt, dev: _pack(dt, dev, [3, 0, 9], [5, 2, 9], d=16),
                      lambda q, k, v, cq, ck: fusedllm.attention_varlen(q, k, v, cq, ck, causal=True, window=4),
                      (0, 1, 2), OPCHECK))
    return tuple(out)


def _paged(dt, dev):
    """Two sequences of 5 and 9 keys in pages of 4 (pages [6, 2, 4, 16], a
    block table that reuses no page), queries of one position."""
    pages_k, pages_v = T(dt, dev, 6, 2, 4, 16), T(dt, dev, 6, 2, 4, 16)
    return T(dt, dev, 2, 4, 1, 16), pages_k, pages_v, I32([[5, 1, 0], [2, 3, 4]], dev), I32([5, 9], dev)


def _int8(dt, dev):
    q, k, v = _qkv(dt, dev, 1, 4, 2, 3, 6, 16)
    return (q, *fusedllm.quantize_kv(k), *fusedllm.quantize_kv(v))


def _cache_samples():
    return (
        sample("paged", _paged, lambda q, k, v, table, lens: fusedllm.attention(q, k, v, causal=True, kv_lens=lens,
                                                                                block_table=table),
               (), OPCHECK, COMPILE),
        sample("kv_lens", lambda dt, dev: (*_qkv(dt, dev, 2, 4, 2, 3, 8, 16), I32([5, 8], dev)),
               lambda q, k, v, lens: fusedllm.attention(q, k, v, causal=True, kv_lens=lens), (), OPCHECK),
        sample("int8", _int8, lambda q, k8, ks, v8, vs: fusedllm.attention(q, k8, v8, causal=True, k_scale=ks,
                                                                           v_scale=vs), (), OPCHECK),
    )


def _quantize_samples():
    return (
        sample("int8", lambda dt, dev: (T(dt, dev, 2, 3, 5, 24),), lambda x: fusedllm.quantize_kv(x), (), OPCHECK),
        sample("into_slots", lambda dt, dev: (T(dt, dev, 2, 3, 1, 24),
                                              torch.zeros(2, 3, 4, 24, dtype=torch.int8, device=dev),
                                              torch.zeros(2, 3, 4, device=dev)),
               lambda x, values, scales: fusedllm.quantize_kv(x, values.clone()[:, :, 2:3], scales.clone()[:, :, 2:3]),
               (), OPCHECK),
        sample("decoding_step", lambda dt, dev: (T(dt, dev, 2, 4, 1, 32), T(dt, dev, 2, 2, 1, 32), T(dt, dev, 2, 2, 1, 32),
                                                 torch.randint(-127, 128, (2, 2, 16, 32), dtype=torch.int8, device=dev),
                                                 torch.rand(2, 2, 16, device=dev),
                                                 torch.randint(-127, 128, (2, 2, 16, 32), dtype=torch.int8, device=dev),
                                                 torch.rand(2, 2, 16, device=dev)),
               _int8_cache_step, (), COMPILE),
    )


def _int8_cache_step(q, k, v, cache_k, k_scale, cache_v, v_scale, held=9):
    """Quantizes the new key and value into slot `held` of (copies of) the
    caches, then attends over the held slots and the new one."""
    cache_k, k_scale, cache_v, v_scale = (t.clone() for t in (cache_k, k_scale, cache_v, v_scale))
    fusedllm.quantize_kv(k, cache_k[:, :, held:held + 1], k_scale[:, :, held:held + 1])
    fusedllm.quantize_kv(v, cache_v[:, :, held:held + 1], v_scale[:, :, held:held + 1])
    end = held + 1
    return fusedllm.attention(q, cache_k[:, :, :end], cache_v[:, :, :end], k_scale=k_scale[:, :, :end],
                              v_scale=v_scale[:, :, :end])


# --- linear cross-entropy -------------------------------------------------------------------------

def _ce_inputs(dt, dev, tokens, hidden, vocab, ignored=0.25):
    h = T(dt, dev, tokens, hidden)
    w = T(dt, dev, vocab, hidden, scale=2.0 / hidden ** 0.5)  # logits of a few units, as a trained head gives
    t = torch.randint(0, vocab, (tokens,))
    t[torch.rand(tokens) < ignored] = -100
    return h, w, T(dt, dev, vocab), t.to(dev)


def _ce_samples():
    out = []
    for reduction in ("mean", "sum", "none"):
        for name, options in [("plain", {}), ("all_options", dict(label_smoothing=0.3, softcap=2.0, z_loss=0.1))]:
            out.append(sample(
                f"{reduction}-{name}-chunks_of_3", lambda dt, dev: _ce_inputs(dt, dev, 7, 5, 11),
                lambda h, w, b, t, r=reduction, o=options: fusedllm.linear_cross_entropy(h, w, t, bias=b, reduction=r,
                                                                                         **o),
                (0, 1, 2), variants=True, env=(("FUSEDLLM_CE_CHUNK_ROWS", "3"),)))
        out.append(sample(
            f"{reduction}-ignored_half", lambda dt, dev: _ce_inputs(dt, dev, 33, 16, 70, ignored=0.5),
            lambda h, w, b, t, r=reduction: fusedllm.linear_cross_entropy(h, w, t, bias=b, reduction=r,
                                                                          label_smoothing=0.1),
            (0, 1, 2), COMPILE))
    out.append(sample("no_bias-softcap", lambda dt, dev: _ce_inputs(dt, dev, 6, 4, 9)[::3],
                      lambda h, t: fusedllm.linear_cross_entropy(h, h.new_ones(9, 4), t, softcap=2.0, z_loss=1e-3),
                      (0,), OPCHECK))
    return tuple(out)


# --- mixture of experts ---------------------------------------------------------------------------

def _experts(dt, dev, tokens, hidden, inter, experts, top_k, transposed=False, biases=False):
    x = T(dt, dev, tokens, hidden)
    gate_up = T(dt, dev, experts, 2 * inter, hidden, scale=hidden ** -0.5)
    down = T(dt, dev, experts, hidden, inter, scale=inter ** -0.5)
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    indices = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(dev)
    weights = torch.rand(tokens, top_k, dtype=torch.float64).to(dtype=dt, device=dev)
    extra = (T(dt, dev, experts, 2 * inter, scale=0.5), T(dt, dev, experts, hidden, scale=0.5)) if biases else ()
    return (x, indices, weights, gate_up, down, *extra)


def _experts_samples():
    out = []
    for activation in ("silu", "gelu_tanh"):
        out.append(sample(activation, lambda dt, dev: _experts(dt, dev, 7, 5, 3, 4, 2),
                          lambda x, i, w, gu, dn, a=activation: fusedllm.moe_experts(x, i, w, gu, dn, a), (0, 2, 3, 4)))
    out.append(sample("gpt_oss", lambda dt, dev: _experts(dt, dev, 6, 8, 4, 4, 2, transposed=True, biases=True),
                      lambda x, i, w, gu, dn, b1, b2: fusedllm.moe_experts(
                          x, i, w, gu, dn, "gpt_oss", gate_up_bias=b1, down_bias=b2, transposed=True, interleaved=True,
                          limit=1.5),
                      (0, 2, 3, 4, 5, 6), OPCHECK))
    out.append(sample("inference", lambda dt, dev: _experts(dt, dev, 6, 8, 4, 4, 2),
                      lambda x, i, w, gu, dn: fusedllm.moe_experts(x, i, w, gu, dn), (), OPCHECK))
    out.append(sample("routed_layer", lambda dt, dev: (T(dt, dev, 33, 16), T(dt, dev, 33, 8),
                                                       T(dt, dev, 8, 16, 16, scale=0.25), T(dt, dev, 8, 16, 8, scale=0.35)),
                      _routed_layer, (0, 1, 2, 3), COMPILE, devices=("cpu", "cuda")))
    return tuple(out)


def _routed_layer(x, logits, gate_up, down):
    weights, indices = fusedllm.moe_route(logits, 2)
    return fusedllm.moe_experts(x, indices, weights, gate_up, down)


def _route_samples():
    routings = {  # (extra tensors, keyword arguments from them), as the model families route
        "mixtral": (lambda dt, dev: (), lambda: {}),
        "qwen-unnormalized": (lambda dt, dev: (), lambda: dict(normalize=False)),
        "deepseek_v3": (lambda dt, dev: (T(dt, dev, 8, scale=0.1),),
                        lambda b: dict(scoring="sigmoid", correction_bias=b, num_groups=4, top_groups=2, scaling=2.5)),
        "sigmoid-plain": (lambda dt, dev: (), lambda: dict(scoring="sigmoid", normalize=False)),
    }
    return tuple(sample(name, lambda dt, dev, e=extra: (T(dt, dev, 6, 8), *e(dt, dev)),
                        lambda g, *e, kw=kwargs: fusedllm.moe_route(g, 3, **kw(*e))[0], (0,), OPCHECK, GRADCHECK,
                        *((COMPILE,) if name == "deepseek_v3" else ()))
                 for name, (extra, kwargs) in routings.items())


TABLE = (
    Entry("rms_norm", ("rms_norm", "rms_norm_backward"), "refused", _rms_samples()),
    Entry("fused_add_rms_norm", ("fused_add_rms_norm", "rms_norm_backward"), "refused", _add_rms_samples()),
    Entry("swiglu", ("swiglu", "swiglu_backward", "swiglu_packed", "swiglu_packed_backward"), "refused",
          _swiglu_samples()),
    Entry("apply_rope", ("rope", "rope_"), "through", _rope_samples()),
    Entry("attention", ("attention", "attention_backward"), "refused", _attention_samples()),
    Entry("attention_varlen", ("attention", "attention_backward"), "refused", _varlen_samples()),
    Entry("attention_over_caches", ("attention",), None, _cache_samples()),
    Entry("quantize_kv", ("quantize_kv",), None, _quantize_samples()),
    Entry("linear_cross_entropy", ("linear_cross_entropy", "linear_cross_entropy_pass"), "refused", _ce_samples()),
    Entry("moe_experts", ("moe_experts", "moe_experts_backward"), "refused", _experts_samples()),
    Entry("moe_route", ("moe_route", "moe_route_backward"), "refused", _route_samples()),
)


# --- bad inputs: rows of (op, arguments, the message); tests/test_check_twins.py runs each through
# the compiled operator and its plain twin (CPU tensors). A row where the two disagree today keeps
# ``plain=`` (what the plain path does now) and ``why=``: its agreement test is a strict xfail.

SAME = object()  # the plain path agrees with the compiled one


class Case(NamedTuple):
    id: str
    op: str
    build: Callable[[], tuple]  # fresh positional arguments, the same for both implementations
    # the compiled message after "fusedllm.<op>: " (attention_varlen for packed attention calls; or whole,
    # when it starts with "fusedllm."); None: accepted
    expect: str | re.Pattern | None
    plain: object  # SAME, or what the plain path does today: None (accepts), a message as expect, (type, message)
    why: str | None  # why the two disagree (a strict xfail)


CASES: list[Case] = []


def row(op, name, build, expect=None, *, plain=SAME, why=None):
    assert (plain is SAME) == (why is None), name
    CASES.append(Case(f"{op}-{name}", op, build, expect, plain, why))


def X(*shape, dtype=torch.float32):  # a CPU tensor of normal samples
    return torch.randn(*shape).to(dtype)


def I(*values, dtype=torch.int32):  # noqa: E743
    return torch.tensor(values, dtype=dtype)


F8 = torch.float8_e4m3fn
NAN, INF = float("nan"), float("inf")


# --- rms_norm, fused_add_rms_norm: (input, [residual,] weight, eps, offset, casting) ---------------

def rms(x=None, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    return (X(4, 16) if x is None else x, weight, eps, offset, casting)


row("rms_norm", "valid", lambda: rms(weight=X(16), offset=1.0, casting="gemma"))
row("rms_norm", "valid_no_weight", lambda: rms())
row("rms_norm", "zero_dims", lambda: rms(torch.tensor(1.0)), "input must have at least one dimension")
row("rms_norm", "input_int", lambda: rms(torch.ones(4, 16, dtype=torch.long)),
    "input must be float32, float64, bfloat16 or float16, got torch.int64")
row("rms_norm", "input_int32", lambda: rms(torch.ones(4, 16, dtype=torch.int32)),
    "input must be float32, float64, bfloat16 or float16, got torch.int32")
row("rms_norm", "eps_negative", lambda: rms(eps=-1e-6), "eps must be a finite number >= 0, got -1e-06")
row("rms_norm", "eps_nan", lambda: rms(eps=NAN), "eps must be a finite number >= 0, got nan")
row("rms_norm", "offset_inf", lambda: rms(weight=X(16), offset=INF), "offset must be finite, got inf")
row("rms_norm", "weight_dtype", lambda: rms(weight=X(16).half()),
    "weight has dtype torch.float16 but input has dtype torch.float32")
row("rms_norm", "weight_shape", lambda: rms(weight=X(15)),
    "weight must have shape [16] (the last dim of input), got [15]")
row("rms_norm", "weight_2d", lambda: rms(weight=X(1, 16)),
    "weight must have shape [16] (the last dim of input), got [1, 16]")
row("rms_norm", "offset_without_weight", lambda: rms(offset=1.0),
    "offset=1 needs a weight (y = x * rstd * (offset + weight))")
row("rms_norm", "casting", lambda: rms(casting="t5"), "casting must be 'llama' or 'gemma', got 't5'")


def add_rms(x=None, residual=None, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    return (X(4, 16) if x is None else x, X(4, 16) if residual is None else residual, weight, eps, offset,
            casting)


row("fused_add_rms_norm", "valid", lambda: add_rms(weight=X(16)))
row("fused_add_rms_norm", "zero_dims", lambda: add_rms(torch.tensor(1.0), torch.tensor(2.0)),
    "input must have at least one dimension")
row("fused_add_rms_norm", "input_int", lambda: add_rms(torch.ones(4, 16, dtype=torch.long)),
    "input must be float32, float64, bfloat16 or float16, got torch.int64")
row("fused_add_rms_norm", "eps_inf", lambda: add_rms(eps=INF), "eps must be a finite number >= 0, got inf")
row("fused_add_rms_norm", "weight_shape", lambda: add_rms(weight=X(8)),
    "weight must have shape [16] (the last dim of input), got [8]")
row("fused_add_rms_norm", "casting", lambda: add_rms(casting="Llama"),
    "casting must be 'llama' or 'gemma', got 'Llama'")
row("fused_add_rms_norm", "residual_shape", lambda: add_rms(residual=X(4, 8)),
    "residual must have the shape of input [4, 16], got [4, 8]")
row("fused_add_rms_norm", "residual_1d", lambda: add_rms(residual=X(16)),
    "residual must have the shape of input [4, 16], got [16]")
row("fused_add_rms_norm", "residual_dtype", lambda: add_rms(residual=X(4, 16).double()),
    "residual has dtype torch.float64 but input has dtype torch.float32")


# --- swiglu (gate, up, activation), swiglu_packed (gate_up, activation) --------------------------

row("swiglu", "valid", lambda: (X(4, 8), X(4, 8), "gelu_tanh"))
row("swiglu", "shape", lambda: (X(4, 8), X(4, 9), "silu"),
    "gate and up must have the same shape, got [4, 8] and [4, 9]")
row("swiglu", "up_dtype", lambda: (X(4, 8), X(4, 8).half(), "silu"),
    "up has dtype torch.float16 but gate has dtype torch.float32")
row("swiglu", "gate_int", lambda: (torch.ones(4, 8, dtype=torch.int32),) * 2 + ("silu",),
    "gate must be float32, float64, bfloat16 or float16, got torch.int32")
row("swiglu", "zero_dims", lambda: (torch.tensor(1.0), torch.tensor(2.0), "silu"),
    "gate must have at least one dimension")
row("swiglu", "activation", lambda: (X(4, 8), X(4, 8), "relu"), "activation must be 'silu' or 'gelu_tanh', got 'relu'")

row("swiglu_packed", "valid", lambda: (X(4, 8), "silu"))
row("swiglu_packed", "odd", lambda: (X(4, 7), "silu"),
    "gate_up must be packed [..., 2 * F] as [gate | up]; its last dim 7 is odd")
row("swiglu_packed", "int", lambda: (torch.ones(4, 8, dtype=torch.long), "silu"),
    "gate_up must be float32, float64, bfloat16 or float16, got torch.int64")
row("swiglu_packed", "zero_dims", lambda: (torch.tensor(1.0), "silu"), "gate_up must have at least one dimension")
row("swiglu_packed", "activation", lambda: (X(4, 8), "tanh"), "activation must be 'silu' or 'gelu_tanh', got 'tanh'")


# --- rope, rope_: (q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse) -------
# q [2, 4, 5, 16], k [2, 2, 5, 16], tables of 8 positions [8, 8].

def rope(q=None, k=None, cos=None, sin=None, position_ids=None, offset=0, interleaved=False, rotary_dim=-1,
         inverse=False):
    cos = X(8, 8) if cos is None else cos
    return (X(2, 4, 5, 16) if q is None else q, X(2, 2, 5, 16) if k is None else k, cos,
            X(*cos.shape) if sin is None else sin, position_ids, offset, interleaved, rotary_dim, inverse)


for _op in ("rope", "rope_"):
    row(_op, "valid", lambda: rope(interleaved=True, inverse=True))
    row(_op, "valid_positions", lambda: rope(position_ids=I(7, 6, 0, 1, 2)))
    row(_op, "valid_per_token", lambda: rope(cos=X(1, 5, 8)))
    row(_op, "valid_partial", lambda: rope(cos=X(8, 4), rotary_dim=8))
    row(_op, "q_int", lambda: rope(q=torch.ones(2, 4, 5, 16, dtype=torch.long)),
        "q must be float32, float64, bfloat16 or float16, got torch.int64")
    row(_op, "k_dtype", lambda: rope(k=X(2, 2, 5, 16).double()),
        "k has dtype torch.float64 but q has dtype torch.float32")
    row(_op, "q_3d", lambda: rope(q=X(2, 5, 16)), "q and k must be [B, H, S, D], got [2, 5, 16] and [2, 2, 5, 16]")
    row(_op, "batch", lambda: rope(k=X(1, 2, 5, 16)),
        "q and k must have the same batch and sequence sizes, got [2, 4, 5, 16] and [1, 2, 5, 16]")
    row(_op, "head_dim", lambda: rope(k=X(2, 2, 5, 8)), "q and k must have the same head dim, got 16 and 8")
    for _r in (7, 0, 32, -2):
        row(_op, f"rotary_dim_{_r}", lambda r=_r: rope(cos=X(8, max(r, 0) // 2), rotary_dim=r),
            f"rotary_dim must be a positive even number at most the head dim 16, got {_r}")
    row(_op, "offset_negative", lambda: rope(offset=-1), "offset must be >= 0, got -1")
    row(_op, "table_shapes", lambda: rope(cos=X(8, 8), sin=X(8, 4)),
        "cos and sin must have the same shape, got [8, 8] and [8, 4]")
    row(_op, "table_int", lambda: rope(cos=torch.ones(8, 8, dtype=torch.long), sin=torch.ones(8, 8, dtype=torch.long)),
        "cos must be float32, float64, bfloat16 or float16, got torch.int64")
    row(_op, "table_1d", lambda: rope(cos=X(8)),
        "cos and sin must be [positions, rotary_dim / 2] or [B, S, rotary_dim / 2], got [8]")
    row(_op, "table_width", lambda: rope(cos=X(8, 5)), "cos and sin must have last dim 8 (rotary_dim / 2), got 5")
    row(_op, "per_token_with_offset", lambda: rope(cos=X(2, 5, 8), offset=1),
        "per-token cos/sin [B, S, rotary_dim / 2] are already indexed by position; pass position_ids or offset "
        "only with a [positions, rotary_dim / 2] table")
    row(_op, "per_token_with_positions", lambda: rope(cos=X(2, 5, 8), position_ids=I(0, 1, 2, 3, 4)),
        "per-token cos/sin [B, S, rotary_dim / 2] are already indexed by position; pass position_ids or offset "
        "only with a [positions, rotary_dim / 2] table")
    row(_op, "offset_past_table", lambda: rope(offset=4), "positions 4..8 are past the cos/sin table of 8 positions")
    row(_op, "positions_dtype", lambda: rope(position_ids=torch.zeros(5)),
        "position_ids must be int64 or int32, got torch.float32")
    row(_op, "positions_shape", lambda: rope(position_ids=torch.zeros(3, 5, dtype=torch.long)),
        "position_ids must be [S] or [B, S] = [2, 5], got [3, 5]")
    row(_op, "positions_and_offset", lambda: rope(position_ids=I(0, 1, 2, 3, 4), offset=1),
        "pass either position_ids or offset, not both")
    row(_op, "position_past_table", lambda: rope(position_ids=I(0, 1, 2, 3, 8, dtype=torch.long)),
        f"fusedllm.{_op}: position 8 is outside the cos/sin table of 8 positions")
    row(_op, "position_negative", lambda: rope(position_ids=I([0, 1, 2, 3, 4], [0, 1, -1, 3, 4])),
        f"fusedllm.{_op}: position -1 is outside the cos/sin table of 8 positions")
    row(_op, "position_past_table_no_heads",
        lambda: rope(X(2, 0, 5, 16), X(2, 0, 5, 16), position_ids=I(0, 1, 2, 3, 8)),
        f"fusedllm.{_op}: position 8 is outside the cos/sin table of 8 positions")
    # the tables' dtypes, the per-token table's batch and rows
    row(_op, "sin_dtype", lambda: rope(cos=X(8, 8), sin=X(8, 8).double()), "cos and sin must have the same dtype")
    row(_op, "per_token_batch", lambda: rope(cos=X(3, 5, 8)),
        "per-token cos/sin [B, S, rotary_dim / 2] must have batch 1 or 2, got 3")
    row(_op, "per_token_rows", lambda: rope(cos=X(2, 4, 8)),
        "per-token cos/sin must have 5 rows (the sequence length), got 4")
row("rope_", "strided", lambda: rope(q=X(2, 4, 5, 32)[..., ::2]), "in place, q needs unit stride along its last dim")


# --- attention: the 21 positional arguments of the schema --------------------------------------

ATTENTION_ARGS = ("mask", "scale", "causal", "window", "dropout_p", "seed", "window_right", "softcap", "sinks",
                  "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "k_scale",
                  "v_scale", "kv_lens", "block_table")
ATTENTION_DEFAULTS = dict(mask=None, scale=0.5, causal=False, window=-1, dropout_p=0.0, seed=None, window_right=-1,
                          softcap=0.0, sinks=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                          max_seqlen_q=0, max_seqlen_k=0, k_scale=None, v_scale=None, kv_lens=None,
                          block_table=None)


def attn(q, k, v, **options):
    assert set(options) <= set(ATTENTION_ARGS), options
    values = dict(ATTENTION_DEFAULTS, **options)
    return (q, k, v, *(values[name] for name in ATTENTION_ARGS))


def dense(q=None, k=None, v=None, **options):
    """q [2, 4, 5, 8], k and v [2, 2, 5, 8]."""
    return attn(X(2, 4, 5, 8) if q is None else q, X(2, 2, 5, 8) if k is None else k,
                X(2, 2, 5, 8) if v is None else v, **options)


def varlen(q=None, k=None, v=None, cu_q=None, cu_k=None, **options):
    """Three sequences of 2, 3 and 4 queries and 4, 3 and 2 keys: q [9, 4, 8], k and v [9, 2, 8]."""
    return attn(X(9, 4, 8) if q is None else q, X(9, 2, 8) if k is None else k, X(9, 2, 8) if v is None else v,
                cu_seqlens_q=I(0, 2, 5, 9) if cu_q is None else cu_q,
                cu_seqlens_k=I(0, 4, 7, 9) if cu_k is None else cu_k, **options)


row("attention", "valid", lambda: dense(mask=torch.ones(5, 5, dtype=torch.bool), causal=True, window=3,
                                        window_right=1, softcap=20.0, sinks=X(4), alibi_slopes=X(2, 4)))
row("attention", "valid_float_mask_dropout",
    lambda: dense(mask=X(2, 1, 1, 5).half(), dropout_p=0.3, seed=I(7, dtype=torch.long)))
row("attention", "valid_empty", lambda: dense(X(0, 4, 5, 8), X(0, 2, 5, 8), X(0, 2, 5, 8)))
row("attention", "valid_head_dim_256", lambda: dense(X(1, 2, 2, 256), X(1, 1, 2, 256), X(1, 1, 2, 256)))
row("attention", "cu_seqlens_q_alone", lambda: dense(X(9, 4, 8), X(9, 2, 8), X(9, 2, 8), cu_seqlens_q=I(0, 9)),
    "cu_seqlens_q and cu_seqlens_k go together: pass both or neither")
row("attention", "cu_seqlens_k_alone", lambda: dense(X(9, 4, 8), X(9, 2, 8), X(9, 2, 8), cu_seqlens_k=I(0, 9)),
    "cu_seqlens_q and cu_seqlens_k go together: pass both or neither")
row("attention", "q_not_4d", lambda: dense(q=X(2, 3, 8)),
    "q must be 4-D [batch, q_heads, q_len, head_dim], got shape [2, 3, 8]")
row("attention", "k_not_4d", lambda: dense(k=X(2, 5, 8)),
    "k must be 4-D [batch, kv_heads, kv_len, head_dim], got shape [2, 5, 8]")
row("attention", "v_not_4d", lambda: dense(v=X(1, 2, 2, 5, 8)),
    "v must be 4-D [batch, kv_heads, kv_len, head_dim], got shape [1, 2, 2, 5, 8]")
row("attention", "q_int", lambda: dense(*(torch.ones(2, 2, 5, 8, dtype=torch.long),) * 3),
    "q must be float32, float64, bfloat16 or float16, got torch.int64")
row("attention", "k_dtype", lambda: dense(k=X(2, 2, 5, 8).double()),
    "k has dtype torch.float64 but q has dtype torch.float32")
row("attention", "v_dtype", lambda: dense(v=X(2, 2, 5, 8).half()),
    "v has dtype torch.float16 but q has dtype torch.float32")
row("attention", "k_v_shapes", lambda: dense(v=X(2, 2, 6, 8)),
    "k and v must have the same shape, got [2, 2, 5, 8] and [2, 2, 6, 8]")
row("attention", "head_dims", lambda: dense(k=X(2, 2, 5, 16), v=X(2, 2, 5, 16)),
    "q and k/v must have the same head_dim, got 8 and 16")
row("attention", "batch", lambda: dense(k=X(1, 2, 5, 8), v=X(1, 2, 5, 8)),
    "q and k/v must have the same batch size, got 2 and 1")
row("attention", "max_seqlen_dense", lambda: dense(max_seqlen_k=5),
    "max_seqlen_q / max_seqlen_k are for packed sequences (cu_seqlens) only")
row("attention", "heads", lambda: dense(X(1, 6, 5, 8), X(1, 4, 5, 8), X(1, 4, 5, 8)),
    "the number of query heads (6) must be a multiple of the number of key/value heads (4)")
row("attention", "zero_kv_heads", lambda: dense(k=X(2, 0, 5, 8), v=X(2, 0, 5, 8)),
    "the number of query heads (4) must be a multiple of the number of key/value heads (0)")
row("attention", "head_dim_300", lambda: dense(X(1, 2, 3, 300), X(1, 2, 3, 300), X(1, 2, 3, 300)),
    "head_dim must be between 1 and 256, got 300")
row("attention", "head_dim_0", lambda: dense(X(1, 2, 3, 0), X(1, 2, 3, 0), X(1, 2, 3, 0)),
    "head_dim must be between 1 and 256, got 0")
row("attention", "scale_nan", lambda: dense(scale=NAN), "scale must be a finite number, got nan")
row("attention", "scale_inf", lambda: dense(scale=-INF), "scale must be a finite number, got -inf")
row("attention", "window_0", lambda: dense(window=0), "window must be -1 (no window) or a number of keys >= 1, got 0")
row("attention", "window_-2", lambda: dense(window=-2),
    "window must be -1 (no window) or a number of keys >= 1, got -2")
row("attention", "window_right", lambda: dense(window_right=-3),
    "window_right must be -1 (no bound) or a number of keys >= 0, got -3")
row("attention", "softcap_negative", lambda: dense(softcap=-1.0),
    "softcap must be 0 (none) or a positive number, got -1")
row("attention", "softcap_nan", lambda: dense(softcap=NAN), "softcap must be 0 (none) or a positive number, got nan")
row("attention", "sinks_int", lambda: dense(sinks=torch.ones(4, dtype=torch.long)),
    "sinks must be float32, float64, bfloat16 or float16, got torch.int64")
row("attention", "sinks_shape", lambda: dense(sinks=X(5)), "sinks must be 1-D [q_heads] = [4], got shape [5]")
row("attention", "sinks_2d", lambda: dense(sinks=X(1, 4)), "sinks must be 1-D [q_heads] = [4], got shape [1, 4]")
row("attention", "alibi_dtype", lambda: dense(alibi_slopes=X(4).bfloat16()),
    "alibi_slopes must be float32 or float64, got torch.bfloat16")
row("attention", "alibi_shape", lambda: dense(alibi_slopes=X(3)),
    "alibi_slopes must be [q_heads] = [4] or [batch, q_heads] = [2, 4], got shape [3]")
row("attention", "alibi_batch", lambda: dense(alibi_slopes=X(3, 4)),
    "alibi_slopes must be [q_heads] = [4] or [batch, q_heads] = [2, 4], got shape [3, 4]")
row("attention", "alibi_3d", lambda: dense(alibi_slopes=X(2, 4, 1)),
    "alibi_slopes must be [q_heads] = [4] or [batch, q_heads] = [2, 4], got shape [2, 4, 1]")
row("attention", "mask_dtype", lambda: dense(mask=torch.ones(5, 5, dtype=torch.long)),
    "mask must be a bool keep-mask or a float32, float64, bfloat16 or float16 additive mask, got torch.int64")
row("attention", "mask_shape", lambda: dense(mask=X(5, 4)),
    "mask of shape [5, 4] does not broadcast to [batch, q_heads, q_len, kv_len] = [2, 4, 5, 5]")
row("attention", "mask_batch", lambda: dense(mask=X(3, 1, 5, 5)),
    "mask of shape [3, 1, 5, 5] does not broadcast to [batch, q_heads, q_len, kv_len] = [2, 4, 5, 5]")
row("attention", "mask_5d", lambda: dense(mask=X(1, 1, 1, 5, 5)),
    "mask of shape [1, 1, 1, 5, 5] does not broadcast to [batch, q_heads, q_len, kv_len] = [2, 4, 5, 5]")
row("attention", "dropout_1", lambda: dense(dropout_p=1.0, seed=I(1, dtype=torch.long)),
    "dropout_p must be in [0, 1), got 1")
row("attention", "dropout_negative", lambda: dense(dropout_p=-0.1), "dropout_p must be in [0, 1), got -0.1")
row("attention", "dropout_without_seed", lambda: dense(dropout_p=0.5),
    "dropout_p > 0 needs seed, a one-element int64 CPU tensor")
row("attention", "dropout_float_seed", lambda: dense(dropout_p=0.5, seed=torch.tensor([1.0])),
    "dropout_p > 0 needs seed, a one-element int64 CPU tensor")
row("attention", "mask_and_sinks", lambda: dense(mask=torch.ones(5, 5, dtype=torch.long), sinks=X(5)),
    "mask must be a bool keep-mask or a float32, float64, bfloat16 or float16 additive mask, got torch.int64")
row("attention", "mask_and_alibi", lambda: dense(mask=X(5, 4), alibi_slopes=X(3)),
    "mask of shape [5, 4] does not broadcast to [batch, q_heads, q_len, kv_len] = [2, 4, 5, 5]")

# packed sequences (cu_seqlens)
row("attention", "varlen_valid", lambda: varlen(causal=True, sinks=X(4), alibi_slopes=X(3, 4), max_seqlen_q=4,
                                                max_seqlen_k=4))
row("attention", "varlen_no_sequence", lambda: varlen(X(0, 4, 8), X(0, 2, 8), X(0, 2, 8), I(0), I(0)))
row("attention", "varlen_q_4d", lambda: varlen(q=X(1, 4, 9, 8)),
    "with cu_seqlens, q must be 3-D [total_q, q_heads, head_dim], got shape [1, 4, 9, 8]")
row("attention", "varlen_k_4d", lambda: varlen(k=X(1, 2, 9, 8)),
    "with cu_seqlens, k must be 3-D [total_k, kv_heads, head_dim], got shape [1, 2, 9, 8]")
row("attention", "varlen_v_2d", lambda: varlen(v=X(9, 16)),
    "with cu_seqlens, v must be 3-D [total_k, kv_heads, head_dim], got shape [9, 16]")
row("attention", "varlen_lengths", lambda: varlen(cu_q=I(0, 5, 9)),
    "cu_seqlens_q and cu_seqlens_k must have the same length (num_seqs + 1), got 3 and 4")
row("attention", "varlen_q_dtype", lambda: varlen(cu_q=I(0, 2, 5, 9, dtype=torch.long)),
    "cu_seqlens_q must be int32, got torch.int64")
row("attention", "varlen_k_dtype", lambda: varlen(cu_k=I(0, 4, 7, 9, dtype=torch.long)),
    "cu_seqlens_k must be int32, got torch.int64")
row("attention", "varlen_q_2d", lambda: varlen(cu_q=I(0, 2, 5, 9).view(2, 2)),
    "cu_seqlens_q must be 1-D [num_seqs + 1], got shape [2, 2]")
row("attention", "varlen_empty", lambda: varlen(cu_q=I(), cu_k=I()),
    "cu_seqlens_q must be 1-D [num_seqs + 1], got shape [0]")
row("attention", "varlen_q_start", lambda: varlen(cu_q=I(1, 2, 5, 9)), "cu_seqlens_q must start at 0, got 1")
row("attention", "varlen_k_start", lambda: varlen(cu_k=I(2, 4, 7, 9)), "cu_seqlens_k must start at 0, got 2")
row("attention", "varlen_q_decreasing", lambda: varlen(cu_q=I(0, 5, 2, 9)),
    "cu_seqlens_q must be non-decreasing, got 5 then 2 at index 2")
row("attention", "varlen_k_decreasing", lambda: varlen(cu_k=I(0, 4, 3, 9)),
    "cu_seqlens_k must be non-decreasing, got 4 then 3 at index 2")
row("attention", "varlen_q_end", lambda: varlen(cu_q=I(0, 2, 5, 8)), "cu_seqlens_q must end at total_q = 9, got 8")
row("attention", "varlen_k_end", lambda: varlen(cu_k=I(0, 4, 7, 10)), "cu_seqlens_k must end at total_k = 9, got 10")
row("attention", "varlen_max_q_negative", lambda: varlen(max_seqlen_q=-1),
    "max_seqlen_q must be >= 0 (0: the longest), got -1")
row("attention", "varlen_max_q_short", lambda: varlen(max_seqlen_q=3),
    "max_seqlen_q is 3 but cu_seqlens_q has a sequence of length 4")
row("attention", "varlen_max_k_short", lambda: varlen(max_seqlen_k=3),
    "max_seqlen_k is 3 but cu_seqlens_k has a sequence of length 4")
row("attention", "varlen_mask", lambda: varlen(mask=X(9, 9)),
    "mask is not supported with packed sequences (cu_seqlens); each sequence attends within itself, with causal "
    "/ window bounds")
row("attention", "varlen_alibi", lambda: varlen(alibi_slopes=X(2, 4)),
    "alibi_slopes must be [q_heads] = [4] or [num_seqs, q_heads] = [3, 4], got shape [2, 4]")
row("attention", "varlen_sinks", lambda: varlen(sinks=X(2)), "sinks must be 1-D [q_heads] = [4], got shape [2]")
row("attention", "varlen_window", lambda: varlen(window_right=-3),
    "window_right must be -1 (no bound) or a number of keys >= 0, got -3")
row("attention", "varlen_dropout", lambda: varlen(dropout_p=1.0), "dropout_p must be in [0, 1), got 1")


# a KV cache of several lengths, dense: q [2, 4, 3, 8], k and v [2, 2, 6, 8], kv_lens [4, 6]
def cache(q=None, k=None, v=None, kv_lens=None, **options):
    return attn(X(2, 4, 3, 8) if q is None else q, X(2, 2, 6, 8) if k is None else k,
                X(2, 2, 6, 8) if v is None else v, kv_lens=I(4, 6) if kv_lens is None else kv_lens, **options)


# paged: q [2, 4, 1, 8], pages [6, 2, 4, 8], block_table [[0, 1, 2], [3, 4, 5]], kv_lens [5, 9]
def paged(q=None, k=None, v=None, table=None, kv_lens=None, **options):
    return attn(X(2, 4, 1, 8) if q is None else q, X(6, 2, 4, 8) if k is None else k,
                X(6, 2, 4, 8) if v is None else v, kv_lens=I(5, 9) if kv_lens is None else kv_lens,
                block_table=I([0, 1, 2], [3, 4, 5]) if table is None else table, **options)


CACHE_GRAD = ("read a KV cache for inference and have no backward; run under torch.no_grad() or "
              "torch.inference_mode(), or detach q, k and v")

row("attention", "cache_valid", lambda: cache(causal=True, sinks=X(4), alibi_slopes=X(2, 4)))
row("attention", "cache_valid_empty_rows", lambda: cache(kv_lens=I(0, 6)))
row("attention", "cache_with_cu_seqlens", lambda: varlen(X(2, 4, 8), X(2, 2, 8), X(2, 2, 8), I(0, 1, 2), I(0, 1, 2),
                                                         kv_lens=I(1, 1)),
    "kv_lens / block_table take q as [batch, q_heads, q_len, head_dim], not packed sequences (cu_seqlens)")
row("attention", "cache_mask", lambda: cache(mask=torch.ones(3, 6, dtype=torch.bool)),
    "mask is not supported with kv_lens / block_table; each sequence's keys end at its kv_lens entry, bounded by "
    "causal / window")
row("attention", "cache_dropout", lambda: cache(dropout_p=0.1),
    "kv_lens / block_table read a KV cache for inference; dropout_p must be 0, got 0.1")
row("attention", "cache_lens_dtype", lambda: cache(kv_lens=I(4, 6, dtype=torch.long)),
    "kv_lens must be int32, got torch.int64")
row("attention", "cache_lens_shape", lambda: cache(kv_lens=I(4)),
    "kv_lens must be [batch] with batch = 2, got shape [1]")
row("attention", "cache_lens_2d", lambda: cache(kv_lens=I([4, 6])),
    "kv_lens must be [batch] with batch = 2, got shape [1, 2]")
row("attention", "cache_lens_over", lambda: cache(kv_lens=I(4, 7)), "kv_lens[1] = 7 is not in [0, 6] (k's kv_len)")
row("attention", "cache_lens_negative", lambda: cache(kv_lens=I(-1, 6)),
    "kv_lens[0] = -1 is not in [0, 6] (k's kv_len)")
row("attention", "cache_batch", lambda: cache(k=X(1, 2, 6, 8), v=X(1, 2, 6, 8)),
    "q and k/v must have the same batch size, got 2 and 1")
row("attention", "cache_window", lambda: cache(window=0),
    "window must be -1 (no window) or a number of keys >= 1, got 0")
row("attention", "cache_sinks", lambda: cache(sinks=X(3)), "sinks must be 1-D [q_heads] = [4], got shape [3]")
row("attention", "cache_grad", lambda: cache(q=X(2, 4, 3, 8).requires_grad_()), "kv_lens / block_table " + CACHE_GRAD)
row("attention", "cache_q_3d", lambda: cache(q=X(2, 4, 8)),
    "q must be 4-D [batch, q_heads, q_len, head_dim], got shape [2, 4, 8]")
row("attention", "cache_max_seqlen", lambda: cache(max_seqlen_k=3),
    "max_seqlen_q / max_seqlen_k are for packed sequences (cu_seqlens) only")
row("attention", "paged_k_3d", lambda: paged(k=X(6, 2, 8), v=X(6, 2, 8)),
    "k must be 4-D [batch, kv_heads, kv_len, head_dim], got shape [6, 2, 8]")
row("attention", "cache_alibi_batch", lambda: cache(alibi_slopes=X(3, 4)),
    "alibi_slopes must be [q_heads] = [4] or [batch, q_heads] = [2, 4], got shape [3, 4]")
row("attention", "cache_no_keys_scale", lambda: cache(kv_lens=I(0, 0), scale=NAN),
    "scale must be a finite number, got nan")
row("attention", "cache_grad_and_lens_dtype",
    lambda: cache(q=X(2, 4, 3, 8).requires_grad_(), kv_lens=I(4, 6, dtype=torch.long)),
    "kv_lens / block_table " + CACHE_GRAD)

row("attention", "paged_valid", lambda: paged(causal=True))
row("attention", "paged_valid_unread_entry", lambda: paged(table=I([0, 1, -1], [3, 4, 5])))
row("attention", "paged_without_lens", lambda: attn(X(2, 4, 1, 8), X(6, 2, 4, 8), X(6, 2, 4, 8),
                                                    block_table=I([0, 1, 2], [3, 4, 5])),
    "block_table needs kv_lens (int32 [batch], the number of keys of each sequence)")
row("attention", "paged_table_dtype", lambda: paged(table=I([0, 1, 2], [3, 4, 5], dtype=torch.long)),
    "block_table must be int32, got torch.int64")
row("attention", "paged_table_3d", lambda: paged(table=I([0, 1, 2], [3, 4, 5])[:, :, None]),
    "block_table must be [batch, max_pages] with batch = 2, got shape [2, 3, 1]")
row("attention", "paged_page_size_0", lambda: paged(k=X(6, 2, 0, 8), v=X(6, 2, 0, 8)),
    "with block_table, k and v are pages [num_pages, kv_heads, page_size, head_dim] with page_size >= 1, got "
    "shape [6, 2, 0, 8]")
row("attention", "paged_lens_over", lambda: paged(kv_lens=I(13, 9)),
    "kv_lens[0] = 13 is not in [0, 12] (block_table's max_pages * page_size)")
row("attention", "paged_entry", lambda: paged(table=I([0, 99, 2], [3, 4, 5])),
    "block_table[0, 1] = 99 is not a page of k / v (num_pages = 6); sequence 0 has 5 keys, so its first 2 entries "
    "are read")
row("attention", "paged_entry_negative", lambda: paged(table=I([0, 1, 2], [3, 4, -1])),
    "block_table[1, 2] = -1 is not a page of k / v (num_pages = 6); sequence 1 has 9 keys, so its first 3 entries "
    "are read")
row("attention", "paged_grad", lambda: paged(v=X(6, 2, 4, 8).requires_grad_()), "kv_lens / block_table " + CACHE_GRAD)


# int8 / float8 k and v with their scales: q [1, 4, 3, 16], k and v [1, 2, 6, 16], scales [1, 2, 6]
def codes(*shape, dtype=torch.int8):
    return torch.randint(-127, 128, shape, dtype=torch.int8) if dtype == torch.int8 else X(*shape).to(dtype)


def quantized(q=None, k=None, v=None, k_scale=None, v_scale=None, code=torch.int8, **options):
    return attn(X(1, 4, 3, 16) if q is None else q, codes(1, 2, 6, 16, dtype=code) if k is None else k,
                codes(1, 2, 6, 16, dtype=code) if v is None else v,
                k_scale=torch.rand(1, 2, 6) if k_scale is None else k_scale,
                v_scale=torch.rand(1, 2, 6) if v_scale is None else v_scale, **options)


def quantized_pages(k_scale=None, q=None, **options):
    """int8 pages [6, 2, 4, 8] with their scales [6, 2, 4]."""
    return paged(q, codes(6, 2, 4, 8), codes(6, 2, 4, 8), k_scale=torch.rand(6, 2, 4) if k_scale is None else k_scale,
                 v_scale=torch.rand(6, 2, 4), **options)


QUANT_GRAD = "quantized k and v (k_scale / v_scale) " + CACHE_GRAD

row("attention", "int8_valid", lambda: quantized(X(1, 4, 3, 16).bfloat16(), causal=True, sinks=X(4)))
row("attention", "float8_valid", lambda: quantized(code=F8, window=2))
row("attention", "int8_varlen_valid", lambda: varlen(X(9, 4, 8), codes(9, 2, 8), codes(9, 2, 8),
                                                     k_scale=torch.rand(9, 2), v_scale=torch.rand(9, 2)))
row("attention", "int8_paged_valid", lambda: quantized_pages(causal=True))
row("attention", "int8_v_float", lambda: quantized(v=X(1, 2, 6, 16)),
    "k and v are int8 (or float8_e4m3fn) together or not at all, got k torch.int8 and v torch.float32")
row("attention", "int8_v_float8", lambda: quantized(v=codes(1, 2, 6, 16, dtype=F8)),
    "k and v are int8 (or float8_e4m3fn) together or not at all, got k torch.int8 and v torch.float8_e4m3fn")
row("attention", "int8_scales_of_floats", lambda: quantized(k=X(1, 2, 6, 16), v=X(1, 2, 6, 16)),
    "k_scale / v_scale are the scales of int8 (or float8_e4m3fn) k and v, but k and v are torch.float32")
row("attention", "int8_no_scales", lambda: dense(X(1, 4, 3, 16), codes(1, 2, 6, 16), codes(1, 2, 6, 16)),
    "torch.int8 k and v need k_scale and v_scale (float32, one scale per position and kv head)")
row("attention", "float8_no_v_scale",
    lambda: dense(X(1, 4, 3, 16), codes(1, 2, 6, 16, dtype=F8), codes(1, 2, 6, 16, dtype=F8),
                  k_scale=torch.rand(1, 2, 6)),
    "torch.float8_e4m3fn k and v need k_scale and v_scale (float32, one scale per position and kv head)")
row("attention", "int8_q_double", lambda: quantized(X(1, 4, 3, 16).double()),
    "with torch.int8 k and v, q must be float32, bfloat16 or float16, got torch.float64")
row("attention", "int8_k_scale_shape", lambda: quantized(k_scale=torch.rand(1, 2, 5)),
    "k_scale must be [batch, kv_heads, kv_len] = [1, 2, 6], got shape [1, 2, 5]")
row("attention", "int8_v_scale_dtype", lambda: quantized(v_scale=torch.rand(1, 2, 6).half()),
    "v_scale must be float32, got torch.float16")
row("attention", "int8_varlen_scale_shape", lambda: varlen(X(9, 4, 8), codes(9, 2, 8), codes(9, 2, 8),
                                                           k_scale=torch.rand(9, 2, 1), v_scale=torch.rand(9, 2)),
    "k_scale must be [total_k, kv_heads] = [9, 2], got shape [9, 2, 1]")
row("attention", "int8_k_3d", lambda: quantized(k=codes(2, 6, 16)),
    "k must be 4-D [batch, kv_heads, kv_len, head_dim], got shape [2, 6, 16]")
row("attention", "int8_heads", lambda: quantized(X(1, 3, 3, 16)),
    "the number of query heads (3) must be a multiple of the number of key/value heads (2)")
row("attention", "int8_q_grad", lambda: quantized(X(1, 4, 3, 16).requires_grad_()), QUANT_GRAD)
row("attention", "int8_scale_grad", lambda: quantized(k_scale=torch.rand(1, 2, 6).requires_grad_()), QUANT_GRAD)
row("attention", "int8_paged_scale_shape", lambda: quantized_pages(k_scale=torch.rand(6, 2, 3)),
    "k_scale must be [num_pages, kv_heads, page_size] = [6, 2, 4], got shape [6, 2, 3]")
row("attention", "int8_cache_scale_shape",
    lambda: cache(X(2, 4, 3, 16), codes(2, 2, 6, 16), codes(2, 2, 6, 16), k_scale=torch.rand(2, 2, 6),
                  v_scale=torch.rand(2, 1, 6)),
    "v_scale must be [batch, kv_heads, kv_len] = [2, 2, 6], got shape [2, 1, 6]")
row("attention", "int8_paged_scale_dtype", lambda: quantized_pages(k_scale=torch.rand(6, 2, 4).double()),
    "k_scale must be float32, got torch.float64")
row("attention", "int8_paged_grad", lambda: quantized_pages(q=X(2, 4, 1, 8).requires_grad_()), QUANT_GRAD)
row("attention", "int8_sinks_grad", lambda: quantized(sinks=X(4).requires_grad_()), QUANT_GRAD)
row("attention", "int8_scale_shape_and_window", lambda: quantized(k_scale=torch.rand(1, 2, 5), window=0),
    "window must be -1 (no window) or a number of keys >= 1, got 0")
row("attention", "int8_cache_no_keys_q_double",
    lambda: cache(X(2, 4, 3, 16).double(), codes(2, 2, 6, 16), codes(2, 2, 6, 16), kv_lens=I(0, 0),
                  k_scale=torch.rand(2, 2, 6), v_scale=torch.rand(2, 2, 6)),
    "with torch.int8 k and v, q must be float32, bfloat16 or float16, got torch.float64")


# --- quantize_kv (x, values, scales) ------------------------------------------------------------

def quant(x=None, values=None, scales=None):
    x = X(4, 8) if x is None else x
    return (x, torch.empty(x.shape, dtype=torch.int8) if values is None else values,
            torch.empty(x.shape[:-1]) if scales is None else scales)


row("quantize_kv", "valid", lambda: quant(X(2, 3, 5, 8).half()))
row("quantize_kv", "valid_float8", lambda: quant(values=torch.empty(4, 8, dtype=F8)))
row("quantize_kv", "valid_1d", lambda: quant(X(8)))
row("quantize_kv", "x_int", lambda: quant(torch.ones(4, 8, dtype=torch.long)),
    "x must be float32, float64, bfloat16 or float16, got torch.int64")
row("quantize_kv", "x_5d", lambda: quant(X(1, 2, 3, 4, 5)),
    "x must have 1 to 4 dims [..., head_dim], got shape [1, 2, 3, 4, 5]")
row("quantize_kv", "x_0d", lambda: quant(torch.tensor(1.0)), "x must have 1 to 4 dims [..., head_dim], got shape []")
row("quantize_kv", "values_dtype", lambda: quant(values=torch.empty(4, 8)),
    "values must be int8 or float8_e4m3fn, got torch.float32")
row("quantize_kv", "scales_dtype", lambda: quant(scales=torch.empty(4).half()),
    "scales must be float32, got torch.float16")
row("quantize_kv", "values_shape", lambda: quant(values=torch.empty(4, 7, dtype=torch.int8)),
    "values must have x's shape [4, 8], got [4, 7]")
row("quantize_kv", "scales_shape", lambda: quant(scales=torch.empty(4, 1)),
    "scales must be x's shape without its last dim [4], got [4, 1]")
row("quantize_kv", "values_expanded", lambda: quant(values=torch.empty(1, 8, dtype=torch.int8).expand(4, 8)),
    "values has elements that share memory (an expanded view): it is written to")
row("quantize_kv", "scales_expanded", lambda: quant(scales=torch.empty(1).expand(4)),
    "scales has elements that share memory (an expanded view): it is written to")


# --- linear_cross_entropy ------------------------------------------------------------------------
# (hidden, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, z_loss):
# hidden [5, 8], weight [50, 8], bias [50], target [5] (one ignored)

def ce(hidden=None, weight=None, bias=None, target=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
       softcap=0.0, z_loss=0.0):
    return (X(5, 8) if hidden is None else hidden, X(50, 8) if weight is None else weight, bias,
            I(0, 49, -100, 3, 7, dtype=torch.long) if target is None else target, ignore_index, reduction,
            label_smoothing, softcap, z_loss)


row("linear_cross_entropy", "valid", lambda: ce(bias=X(50), reduction="sum", label_smoothing=0.1, softcap=30.0,
                                                z_loss=1e-4))
row("linear_cross_entropy", "valid_none", lambda: ce(reduction="none", label_smoothing=1.0))
row("linear_cross_entropy", "hidden_int", lambda: ce(X(5, 8).int()),
    "hidden must be float32, float64, bfloat16 or float16, got torch.int32")
row("linear_cross_entropy", "hidden_3d", lambda: ce(X(1, 5, 8)),
    "hidden must be [tokens, hidden_size], got shape [1, 5, 8]")
row("linear_cross_entropy", "weight_dtype", lambda: ce(weight=X(50, 8).half()),
    "weight has dtype torch.float16 but hidden has dtype torch.float32")
row("linear_cross_entropy", "weight_width", lambda: ce(weight=X(50, 5)),
    "weight must be [vocab, 8] (hidden's last dim), got shape [50, 5]")
row("linear_cross_entropy", "weight_1d", lambda: ce(weight=X(8)),
    "weight must be [vocab, 8] (hidden's last dim), got shape [8]")
row("linear_cross_entropy", "empty_vocab", lambda: ce(weight=X(0, 8)), "weight has an empty vocabulary (shape [0, 8])")
row("linear_cross_entropy", "bias_shape", lambda: ce(bias=X(7)),
    "bias must be [50] (weight's vocabulary), got shape [7]")
row("linear_cross_entropy", "bias_dtype", lambda: ce(bias=X(50).double()),
    "bias has dtype torch.float64 but hidden has dtype torch.float32")
row("linear_cross_entropy", "target_dtype", lambda: ce(target=X(5)),
    "target must hold int64 class indices, got torch.float32")
row("linear_cross_entropy", "target_shape", lambda: ce(target=I(0, 1, 2, dtype=torch.long)),
    "target must be [5] (one per token of hidden), got shape [3]")
row("linear_cross_entropy", "smoothing", lambda: ce(label_smoothing=1.5), "label_smoothing must be in [0, 1], got 1.5")
row("linear_cross_entropy", "smoothing_nan", lambda: ce(label_smoothing=NAN),
    "label_smoothing must be in [0, 1], got nan")
row("linear_cross_entropy", "softcap", lambda: ce(softcap=-1.0),
    "softcap must be a finite number > 0 (0: no cap), got -1")
row("linear_cross_entropy", "softcap_inf", lambda: ce(softcap=INF),
    "softcap must be a finite number > 0 (0: no cap), got inf")
row("linear_cross_entropy", "z_loss", lambda: ce(z_loss=-0.1), "z_loss must be a finite number >= 0, got -0.1")
row("linear_cross_entropy", "z_loss_nan", lambda: ce(z_loss=NAN), "z_loss must be a finite number >= 0, got nan")
row("linear_cross_entropy", "reduction", lambda: ce(reduction="avg"),
    "reduction must be 'mean', 'sum' or 'none', got 'avg'")
row("linear_cross_entropy", "target_over", lambda: ce(target=I(0, 1, 50, 3, 4, dtype=torch.long)),
    "target[2] = 50 is not a class index in [0, 50) nor ignore_index (-100)")
row("linear_cross_entropy", "target_negative", lambda: ce(target=I(0, -3, 2, 3, 4, dtype=torch.long), ignore_index=0),
    "target[1] = -3 is not a class index in [0, 50) nor ignore_index (0)")
row("linear_cross_entropy", "reduction_and_hidden", lambda: ce(X(5, 8).int(), reduction="avg"),
    "reduction must be 'mean', 'sum' or 'none', got 'avg'")


# --- moe_route (router_logits, top_k, scoring, normalize, correction_bias, num_groups, top_groups, scaling)
# router_logits [5, 4]

def route(logits=None, top_k=2, scoring="softmax", normalize=True, bias=None, num_groups=1, top_groups=1,
          scaling=1.0):
    return (X(5, 4) if logits is None else logits, top_k, scoring, normalize, bias, num_groups, top_groups, scaling)


row("moe_route", "valid", lambda: route(scoring="sigmoid", bias=X(4), num_groups=2, top_groups=1, scaling=2.5))
row("moe_route", "logits_int", lambda: route(torch.ones(5, 4, dtype=torch.long)),
    "router_logits must be float32, float64, bfloat16 or float16, got torch.int64")
row("moe_route", "logits_1d", lambda: route(X(4)), "router_logits must be [tokens, num_experts], got shape [4]")
row("moe_route", "no_experts", lambda: route(X(5, 0)), "router_logits must be [tokens, num_experts], got shape [5, 0]")
row("moe_route", "top_k_over", lambda: route(top_k=5), "top_k must be in [1, num_experts = 4], got 5")
row("moe_route", "top_k_0", lambda: route(top_k=0), "top_k must be in [1, num_experts = 4], got 0")
row("moe_route", "scoring", lambda: route(scoring="relu"), "scoring must be 'softmax' or 'sigmoid', got 'relu'")
row("moe_route", "bias_int", lambda: route(bias=torch.zeros(4, dtype=torch.long)),
    "correction_bias must be float32, float64, bfloat16 or float16, got torch.int64")
row("moe_route", "bias_shape", lambda: route(bias=X(3)), "correction_bias must be [4] (one per expert), got shape [3]")
row("moe_route", "groups", lambda: route(num_groups=3),
    "num_groups must be a positive divisor of num_experts = 4, got 3")
row("moe_route", "groups_0", lambda: route(num_groups=0),
    "num_groups must be a positive divisor of num_experts = 4, got 0")
row("moe_route", "top_groups", lambda: route(num_groups=2, top_groups=3),
    "top_groups must be in [1, num_groups = 2], got 3")
row("moe_route", "top_groups_0", lambda: route(num_groups=2, top_groups=0),
    "top_groups must be in [1, num_groups = 2], got 0")
row("moe_route", "top_k_over_groups", lambda: route(top_k=3, num_groups=2, top_groups=1),
    "top_k = 3 is more than the 2 experts of the top_groups = 1 groups kept")
row("moe_route", "scaling_nan", lambda: route(scaling=NAN), "scaling must be finite, got nan")
row("moe_route", "scaling_inf", lambda: route(scaling=INF), "scaling must be finite, got inf")


# --- moe_experts (hidden, indices, weights, gate_up_proj, down_proj, activation, save_for_backward,
# gate_up_bias, down_bias, transposed, interleaved, alpha, limit): hidden [5, 8], 4 experts of
# intermediate 4: gate_up_proj [4, 8, 8], down_proj [4, 8, 4]; indices and weights [5, 2]

def experts(hidden=None, indices=None, weights=None, gate_up=None, down=None, activation="silu", save=False,
            gate_up_bias=None, down_bias=None, transposed=False, interleaved=False, alpha=1.702, limit=7.0):
    if indices is None:
        indices = I([0, 1], [2, 3], [1, 0], [3, 3], [2, 0], dtype=torch.long)
    return (X(5, 8) if hidden is None else hidden, indices, torch.rand(5, 2) if weights is None else weights,
            X(4, 8, 8) if gate_up is None else gate_up, X(4, 8, 4) if down is None else down, activation, save,
            gate_up_bias, down_bias, transposed, interleaved, alpha, limit)


row("moe_experts", "valid", lambda: experts(save=True, gate_up_bias=X(4, 8), down_bias=X(4, 8), interleaved=True,
                                            activation="gpt_oss", limit=INF))
row("moe_experts", "valid_transposed", lambda: experts(gate_up=X(4, 8, 8), down=X(4, 4, 8), transposed=True))
row("moe_experts", "valid_bf16_float32_weights", lambda: experts(X(5, 8).bfloat16(), gate_up=X(4, 8, 8).bfloat16(),
                                                                 down=X(4, 8, 4).bfloat16()))
row("moe_experts", "hidden_int", lambda: experts(torch.ones(5, 8, dtype=torch.long)),
    "hidden must be float32, float64, bfloat16 or float16, got torch.int64")
row("moe_experts", "hidden_3d", lambda: experts(X(1, 5, 8)),
    "hidden must be [tokens, hidden_size], got shape [1, 5, 8]")
row("moe_experts", "indices_dtype", lambda: experts(indices=torch.zeros(5, 2, dtype=torch.int32)),
    "indices must hold int64 expert indices, got torch.int32")
row("moe_experts", "indices_tokens", lambda: experts(indices=torch.zeros(4, 2, dtype=torch.long)),
    "indices must be [5, top_k] (hidden's tokens), got shape [4, 2]")
row("moe_experts", "indices_no_k", lambda: experts(indices=torch.zeros(5, 0, dtype=torch.long)),
    "indices must be [5, top_k] (hidden's tokens), got shape [5, 0]")
row("moe_experts", "indices_1d", lambda: experts(indices=torch.zeros(5, dtype=torch.long)),
    "indices must be [5, top_k] (hidden's tokens), got shape [5]")
row("moe_experts", "weights_dtype", lambda: experts(weights=torch.rand(5, 2).half()),
    "weights must have hidden's dtype torch.float32, got torch.float16")
row("moe_experts", "weights_dtype_bf16", lambda: experts(X(5, 8).bfloat16(), weights=torch.rand(5, 2).half(),
                                                         gate_up=X(4, 8, 8).bfloat16(), down=X(4, 8, 4).bfloat16()),
    "weights must have hidden's dtype torch.bfloat16 or torch.float32, got torch.float16")
row("moe_experts", "weights_shape", lambda: experts(weights=torch.rand(5, 1)),
    "weights must have indices' shape [5, 2], got [5, 1]")
row("moe_experts", "gate_up_dtype", lambda: experts(gate_up=X(4, 8, 8).double()),
    "gate_up_proj has dtype torch.float64 but hidden has dtype torch.float32")
row("moe_experts", "down_dtype", lambda: experts(down=X(4, 8, 4).half()),
    "down_proj has dtype torch.float16 but hidden has dtype torch.float32")
row("moe_experts", "gate_up_odd", lambda: experts(gate_up=X(4, 7, 8)),
    "gate_up_proj must be [num_experts, 2 * intermediate, 8] (hidden's last dim), got shape [4, 7, 8]")
row("moe_experts", "gate_up_width", lambda: experts(gate_up=X(4, 8, 6)),
    "gate_up_proj must be [num_experts, 2 * intermediate, 8] (hidden's last dim), got shape [4, 8, 6]")
row("moe_experts", "no_experts", lambda: experts(gate_up=X(0, 8, 8)),
    "gate_up_proj must be [num_experts, 2 * intermediate, 8] (hidden's last dim), got shape [0, 8, 8]")
row("moe_experts", "gate_up_transposed", lambda: experts(gate_up=X(4, 6, 8), transposed=True),
    "gate_up_proj must be [num_experts, 8, 2 * intermediate] (hidden's last dim; transposed=True), got shape [4, 6, 8]")
row("moe_experts", "down_shape", lambda: experts(down=X(4, 8, 3)),
    "down_proj must be [4, 8, 4] (num_experts, hidden_size, intermediate), got shape [4, 8, 3]")
row("moe_experts", "down_transposed", lambda: experts(transposed=True),
    "down_proj must be [4, 4, 8] (num_experts, intermediate, hidden_size; transposed=True), got shape [4, 8, 4]")
row("moe_experts", "gate_up_bias_shape", lambda: experts(gate_up_bias=X(4, 4)),
    "gate_up_bias must be [4, 8] (num_experts, 2 * intermediate), got shape [4, 4]")
row("moe_experts", "gate_up_bias_dtype", lambda: experts(gate_up_bias=torch.zeros(4, 8, dtype=torch.long)),
    "gate_up_bias has dtype torch.int64 but hidden has dtype torch.float32")
row("moe_experts", "down_bias_shape", lambda: experts(down_bias=X(8)),
    "down_bias must be [4, 8] (num_experts, hidden_size), got shape [8]")
row("moe_experts", "down_bias_dtype", lambda: experts(down_bias=X(4, 8).double()),
    "down_bias has dtype torch.float64 but hidden has dtype torch.float32")
row("moe_experts", "activation", lambda: experts(activation="relu"),
    "activation must be 'silu', 'gelu_tanh' or 'gpt_oss', got 'relu'")
row("moe_experts", "alpha", lambda: experts(activation="gpt_oss", alpha=NAN), "alpha must be finite, got nan")
row("moe_experts", "limit_0", lambda: experts(activation="gpt_oss", limit=0.0),
    "limit must be positive (inf: no clamp), got 0")
row("moe_experts", "limit_nan", lambda: experts(limit=NAN), "limit must be positive (inf: no clamp), got nan")
row("moe_experts", "index_over", lambda: experts(indices=I([0, 1], [2, 3], [1, 0], [3, 4], [2, 0], dtype=torch.long)),
    "indices[3, 1] = 4 is not an expert index in [0, 4)")
row("moe_experts", "index_negative",
    lambda: experts(indices=I([0, -1], [2, 3], [1, 0], [3, 3], [2, 0], dtype=torch.long)),
    "indices[0, 1] = -1 is not an expert index in [0, 4)")
