"""Each public op's sample inputs, in one table (PyTorch's OpInfo as the model).

tests/test_op_table.py runs every sample through the checks every op owes:
``torch.library.opcheck`` of each operator the sample reaches, forward and
backward (found by running it, so a new backward op is checked without being
listed); ``gradcheck`` in float64; ``torch.compile(fullgraph=True)`` against
eager; the second-derivative contract; and, for samples marked ``variants``,
the gradcheck again under every compiled CPU variant (test_cpu_variants.py).
Each op's bad inputs are the rows of tests/test_check_twins.py, under the same
op names.

Adding an op: an Entry with its samples. A sample builds its tensors for a
dtype and device, and runs the public function on them; ``grad`` names the
tensors the function is differentiable in."""

from __future__ import annotations

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
