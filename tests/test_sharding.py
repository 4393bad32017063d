"""fusedllm's ops on DTensors: each op on sharded inputs equals the op on whole
tensors (forward and gradients), computes without communicating where its
sharding rule says a shard suffices, lets DTensor redistribute other
placements, and refuses what no redistribution makes right. Gloo processes on
the CPU; one spawn runs every case, each case is its own test."""

from __future__ import annotations

import math
import traceback

import pytest
import torch
import torch.distributed as dist

from checks import FORWARD_TOL, GRAD_TOL, assert_close, one_thread
from testkit import gloo

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo")


def _flat(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


class _Cases:
    """Runs named cases on every rank (the same collectives in the same order)
    and keeps rank 0's outcome of each: None, or the failure."""

    def __init__(self, mesh):
        self.mesh, self.results = mesh, {}

    def run(self, name, fn):
        try:
            fn()
            self.results[name] = None
        except Exception:
            self.results[name] = traceback.format_exc(limit=6)

    def compare(self, f, inputs, placements, out_placements=None, local=True, grad=True, constants=()):
        """f(*inputs) on whole tensors against f on DTensors placed as ``placements``
        (None: a plain tensor, a number, or None): outputs, the placements they come
        out in, whether the forward communicated, and each float input's gradient
        (but those at the positions in ``constants``)."""
        from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
        from torch.distributed.tensor.debug import CommDebugMode

        def leaf(t, i):
            return t.requires_grad_() if grad and t.is_floating_point() and i not in constants else t

        whole = [leaf(t.clone(), i) if isinstance(t, torch.Tensor) else t for i, t in enumerate(inputs)]
        dts = [leaf(distribute_tensor(t.detach().clone(), self.mesh, p), i) if p is not None else t
               for i, (t, p) in enumerate(zip(inputs, placements))]
        expected = _flat(f(*whole))
        with CommDebugMode() as comm:
            got = _flat(f(*dts))
        if local:
            assert comm.get_total_counts() == 0, f"forward communicated: {comm.get_comm_counts()}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert isinstance(g, DTensor), f"output {i} is {type(g).__name__}"
            if out_placements is not None:
                assert tuple(g.placements) == tuple(out_placements[i]), \
                    f"output {i} placed {g.placements}, expected {out_placements[i]}"
            assert_close(g.full_tensor(), e.detach(), FORWARD_TOL[e.dtype], f"output {i}")
        if not grad:
            return
        torch.manual_seed(1)
        seeds = [torch.randn(e.shape, dtype=e.dtype) for e in expected]
        torch.autograd.backward([e for e in expected if e.requires_grad],
                                [s for s, e in zip(seeds, expected) if e.requires_grad])
        torch.autograd.backward(
            [g for g in got if g.requires_grad],
            [distribute_tensor(s, self.mesh, [Replicate() if p.is_partial() else p for p in g.placements])
             for s, g in zip(seeds, got) if g.requires_grad])
        for i, (w, d) in enumerate(zip(whole, dts)):
            if isinstance(w, torch.Tensor) and w.requires_grad:
                assert d.grad is not None, f"input {i} got no gradient"
                assert_close(d.grad.full_tensor(), w.grad, GRAD_TOL[w.dtype], f"gradient of input {i}")

    def refused(self, f, match):
        try:
            f()
        except (ValueError, RuntimeError) as e:  # DTensor wraps the rule's error in a RuntimeError
            assert match in str(e), f"message {str(e)!r} lacks {match!r}"
            return
        raise AssertionError(f"not refused ({match!r} expected)")


def _cases_1d(cases: _Cases):
    import fusedllm
    from torch.distributed.tensor import Partial, Replicate, Shard

    R, S = Replicate(), Shard
    torch.manual_seed(0)
    x, w, res = torch.randn(4, 6, 8), torch.randn(8), torch.randn(4, 6, 8)

    for d in (0, 1):
        cases.run(f"rms_norm rows Shard({d})", lambda d=d: cases.compare(
            fusedllm.rms_norm, [x, w], [[S(d)], [R]], [[S(d)]]))
    cases.run("rms_norm hidden Shard(2) redistributed", lambda: cases.compare(
        fusedllm.rms_norm, [x, w], [[S(2)], [R]], local=False))
    cases.run("fused_add_rms_norm rows Shard(1)", lambda: cases.compare(
        fusedllm.fused_add_rms_norm, [x, res, w], [[S(1)], [S(1)], [R]], [[S(1)], [S(1)]]))

    gate, up = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
    cases.run("swiglu intermediate Shard(2)", lambda: cases.compare(
        fusedllm.swiglu, [gate, up], [[S(2)], [S(2)]], [[S(2)]]))
    packed = torch.randn(4, 6, 16)
    cases.run("swiglu packed rows Shard(0)", lambda: cases.compare(
        fusedllm.swiglu, [packed], [[S(0)]], [[S(0)]]))
    cases.run("swiglu packed Shard(2) redistributed", lambda: cases.compare(
        fusedllm.swiglu, [packed], [[S(2)]], local=False))

    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
    cos, sin = fusedllm.rope_tables(8, 16)
    pos2, pos1 = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]]), torch.arange(2, 8)
    cases.run("rope heads Shard(1)", lambda: cases.compare(
        fusedllm.apply_rope, [q, k, cos, sin], [[S(1)], [S(1)], [R], [R]], [[S(1)], [S(1)]], constants=(2, 3)))
    cases.run("rope batch Shard(0) with [B, S] positions", lambda: cases.compare(
        fusedllm.apply_rope, [q, k, cos, sin, pos2], [[S(0)], [S(0)], [R], [R], [S(0)]], [[S(0)], [S(0)]], constants=(2, 3)))
    cases.run("rope sequence Shard(2) with [S] positions", lambda: cases.compare(
        fusedllm.apply_rope, [q, k, cos, sin, pos1], [[S(2)], [S(2)], [R], [R], [S(0)]], [[S(2)], [S(2)]], constants=(2, 3)))
    cases.run("rope sequence Shard(2) without positions redistributed", lambda: cases.compare(
        fusedllm.apply_rope, [q, k, cos, sin], [[S(2)], [S(2)], [R], [R]], local=False, constants=(2, 3)))
    hf_cos, hf_sin = torch.randn(2, 6, 8), torch.randn(2, 6, 8)  # per token, HF's duplicated halves
    cases.run("rope sequence Shard(2) with per-token tables Shard(1)", lambda: cases.compare(
        fusedllm.apply_rope, [q, k, hf_cos, hf_sin], [[S(2)], [S(2)], [S(1)], [S(1)]], [[S(2)], [S(2)]], constants=(2, 3)))

    def rope_inplace(qp, kp, match=None):
        from torch.distributed.tensor import distribute_tensor
        dq, dk, dcos, dsin = (distribute_tensor(t.clone(), cases.mesh, [p])
                              for t, p in ((q, qp), (k, kp), (cos, R), (sin, R)))
        call = lambda: fusedllm.apply_rope(dq, dk, dcos, dsin, inplace=True)  # noqa: E731
        if match:
            return cases.refused(call, match)
        call()
        eq, ek = fusedllm.apply_rope(q, k, cos, sin)
        assert_close(dq.full_tensor(), eq, FORWARD_TOL[q.dtype], "q rotated in place")
        assert_close(dk.full_tensor(), ek, FORWARD_TOL[k.dtype], "k rotated in place")

    cases.run("rope in place heads Shard(1)", lambda: rope_inplace(S(1), S(1)))
    cases.run("rope in place refuses q and k sharded differently",
              lambda: rope_inplace(S(1), S(0), "rope_ on DTensors: writes its arguments in place"))

    qa, ka, va = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    causal = lambda q, k, v: fusedllm.attention(q, k, v, causal=True)  # noqa: E731
    cases.run("attention heads Shard(1)", lambda: cases.compare(
        causal, [qa, ka, va], [[S(1)]] * 3, [[S(1)]]))
    cases.run("attention batch Shard(0)", lambda: cases.compare(
        causal, [qa, ka, va], [[S(0)]] * 3, [[S(0)]]))
    cases.run("attention sequence Shard(2) redistributed", lambda: cases.compare(
        causal, [qa, ka, va], [[S(2)]] * 3, local=False))
    k1, v1 = torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8)
    cases.run("attention one kv head: heads not split from their kv head", lambda: cases.compare(
        causal, [qa, k1, v1], [[S(1)]] * 3, local=False))
    q3, k3, v3 = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    cases.run("attention, 3 heads on 2 ranks without groups", lambda: cases.compare(
        causal, [q3, k3, v3], [[S(1)]] * 3, [[S(1)]]))
    sinks, mask = torch.randn(4), torch.rand(2, 1, 6, 6) > 0.3
    mask[..., 0] = True
    cases.run("attention heads Shard(1) with sinks Shard(0)", lambda: cases.compare(
        lambda q, k, v, s: fusedllm.attention(q, k, v, causal=True, sinks=s),
        [qa, ka, va, sinks], [[S(1)]] * 3 + [[S(0)]], [[S(1)]]))
    cases.run("attention batch Shard(0) with sinks and a [B, 1, S, S] mask", lambda: cases.compare(
        lambda q, k, v, s, m: fusedllm.attention(q, k, v, sinks=s, mask=m),
        [qa, ka, va, sinks, mask], [[S(0)]] * 3 + [[R], [S(0)]], [[S(0)]]))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    qv, kv_, vv = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    cases.run("attention_varlen heads Shard(1)", lambda: cases.compare(
        lambda q, k, v, c: fusedllm.attention_varlen(q, k, v, c, c, causal=True),
        [qv, kv_, vv, cu], [[S(1)]] * 3 + [[R]], [[S(1)]]))

    def dropout_refused():
        from torch.distributed.tensor import distribute_tensor
        dq, dk, dv = (distribute_tensor(t, cases.mesh, [S(1)]) for t in (qa, ka, va))
        cases.refused(lambda: fusedllm.attention(dq, dk, dv, dropout_p=0.1),
                      "attention on DTensors: dropout_p=0.1")

    cases.run("attention refuses dropout", dropout_refused)

    def quantize(x_p, values_p, scales_p, match=None):
        from torch.distributed.tensor import distribute_tensor
        xk = torch.randn(2, 2, 6, 8)
        values = distribute_tensor(torch.zeros(2, 2, 6, 8, dtype=torch.int8), cases.mesh, [values_p])
        scales = distribute_tensor(torch.zeros(2, 2, 6), cases.mesh, [scales_p])
        call = lambda: fusedllm.quantize_kv(distribute_tensor(xk, cases.mesh, [x_p]), values, scales)  # noqa: E731
        if match:
            return cases.refused(call, match)
        call()
        ev, es = fusedllm.quantize_kv(xk)
        assert torch.equal(values.full_tensor(), ev), "values written in place"
        assert torch.equal(scales.full_tensor(), es), "scales written in place"

    cases.run("quantize_kv into a cache Shard(1), x Shard(1)", lambda: quantize(S(1), S(1), S(1)))
    cases.run("quantize_kv into a cache Shard(1), x redistributed", lambda: quantize(S(2), S(1), S(1)))
    cases.run("quantize_kv refuses values and scales sharded differently",
              lambda: quantize(S(1), S(1), S(0), "quantize_kv on DTensors: writes its arguments in place"))

    hidden, head, target = torch.randn(8, 16), torch.randn(32, 16), torch.randint(0, 32, (8,))
    target[3] = -100
    for reduction, out in (("none", S(0)), ("sum", Partial()), ("mean", Partial())):
        cases.run(f"linear_cross_entropy tokens Shard(0), reduction {reduction}", lambda r=reduction, o=out: cases.compare(
            lambda h, wt, t: fusedllm.linear_cross_entropy(h, wt, t, reduction=r),
            [hidden, head, target], [[S(0)], [R], [S(0)]], [[o]], local=r != "mean"))
    cases.run("linear_cross_entropy vocabulary Shard(0) redistributed", lambda: cases.compare(
        fusedllm.linear_cross_entropy, [hidden, head, target], [[R], [S(0)], [R]], local=False))

    logits, gate_up, down = torch.randn(8, 4), torch.randn(4, 2 * 6, 16) / 4, torch.randn(4, 16, 6) / 4

    def moe(h, lg, gu, dn):
        weights, indices = fusedllm.moe_route(lg, 2)
        return fusedllm.moe_experts(h, indices, weights, gu, dn)

    cases.run("moe tokens Shard(0), experts replicated", lambda: cases.compare(
        moe, [hidden, logits, gate_up, down], [[S(0)], [S(0)], [R], [R]], [[S(0)]]))


def _cases_2d(cases: _Cases):
    import fusedllm
    from torch.distributed.tensor import Replicate, Shard

    torch.manual_seed(0)
    x, w = torch.randn(4, 6, 8), torch.randn(8)
    cases.run("2-D mesh: rms_norm Shard(0) x Shard(1)", lambda: cases.compare(
        fusedllm.rms_norm, [x, w], [[Shard(0), Shard(1)], [Replicate()] * 2], [[Shard(0), Shard(1)]]))
    q, k, v = torch.randn(2, 8, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    cases.run("2-D mesh: attention batch x heads", lambda: cases.compare(
        lambda q, k, v: fusedllm.attention(q, k, v, causal=True), [q, k, v], [[Shard(0), Shard(1)]] * 3,
        [[Shard(0), Shard(1)]]))
    k1, v1 = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    # heads split only over the second mesh dim would do; the rule asks for a
    # kv head count that any split over the mesh keeps whole
    cases.run("2-D mesh: attention batch x heads, 2 kv heads on 4 ranks", lambda: cases.compare(
        lambda q, k, v: fusedllm.attention(q, k, v, causal=True), [q, k1, v1], [[Shard(0), Shard(1)]] * 3,
        local=False))


def _op_cases(rank, world, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh
    cases = _Cases(init_device_mesh("cpu", mesh_shape))
    (_cases_1d if len(mesh_shape) == 1 else _cases_2d)(cases)
    return cases.results


def _spawn(tmp_path_factory, mesh_shape):
    return gloo.spawn(_op_cases, math.prod(mesh_shape), tmp_path_factory.mktemp("sharding"), mesh_shape)


@pytest.fixture(scope="module")
def results_1d(tmp_path_factory):
    return _spawn(tmp_path_factory, (2,))


@pytest.fixture(scope="module")
def results_2d(tmp_path_factory):
    return _spawn(tmp_path_factory, (2, 2))


def test_every_op_has_a_rule():
    import fusedllm  # noqa: F401
    from fusedllm import _sharding
    names = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fusedllm::")}
    ruled = set(_sharding.RULES)
    assert names == ruled


def test_ops_on_two_ranks(results_1d):
    failed = {name: err for name, err in results_1d.items() if err is not None}
    assert len(results_1d) >= 30, sorted(results_1d)
    assert not failed, "\n".join(f"--- {n}\n{e}" for n, e in failed.items())


def test_ops_on_a_two_by_two_mesh(results_2d):
    failed = {name: err for name, err in results_2d.items() if err is not None}
    assert len(results_2d) == 3, sorted(results_2d)
    assert not failed, "\n".join(f"--- {n}\n{e}" for n, e in failed.items())


# --- tensor parallelism of a patched Hugging Face Llama ------------------------------------------

_STEPS = 3


def _llama_config():
    import transformers
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _llama_batch():
    gen = torch.Generator().manual_seed(0)
    start, stride = torch.randint(0, 64, (4, 1), generator=gen), torch.randint(1, 4, (4, 1), generator=gen)
    return (start + stride * torch.arange(16)) % 64  # sequence parallelism splits 16 evenly


def _llama(state, cross_entropy):
    import fusedllm
    import transformers
    model = transformers.LlamaForCausalLM(_llama_config())
    model.load_state_dict(state)
    fusedllm.patch(model, cross_entropy=cross_entropy)
    return model


def _train_llama(model, ids):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(_STEPS):
        opt.zero_grad(set_to_none=True)
        # positions given: under sequence parallelism the model sees only its slice
        loss = model(input_ids=ids, labels=ids, position_ids=torch.arange(ids.shape[1])[None]).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _tp_plan(sequence_parallel, lm_head=False):
    """The usual Llama plan: q, k, v, gate and up split by output features,
    o and down by input features; with sequence parallelism the norms and the
    residual stream also hold a slice of the sequence each."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    if not sequence_parallel:
        layer = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
        layer |= {"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                  "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        top = {"lm_head": ColwiseParallel(output_layouts=Replicate())} if lm_head else {}
        return top, layer
    colwise = ColwiseParallel(input_layouts=Shard(1))
    rowwise = RowwiseParallel(output_layouts=Shard(1))
    layer = {f"self_attn.{p}_proj": colwise for p in "qkv"}
    layer |= {"self_attn.o_proj": rowwise, "mlp.gate_proj": colwise, "mlp.up_proj": colwise,
              "mlp.down_proj": rowwise, "input_layernorm": SequenceParallel(),
              "post_attention_layernorm": SequenceParallel()}
    top = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "model.norm": SequenceParallel(),
           "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    return top, layer


# name: (sequence parallel, fused loss, LM head split over the vocabulary)
_TP_RUNS = {"tensor parallel": (False, False, False), "tensor and sequence parallel": (True, False, True),
            "tensor parallel, fused loss": (False, True, False),
            "tensor parallel, fused loss, vocabulary-parallel LM head": (False, True, True),
            "tensor and sequence parallel, fused loss": (True, True, True)}


def _tp_runs(rank, world, state):
    """Each of _TP_RUNS trained on a tensor-parallel mesh of `world` ranks: the
    losses and the gathered parameters (or the failure), by name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    ids, results = _llama_batch(), {}
    for name, (sequence_parallel, cross_entropy, lm_head) in _TP_RUNS.items():
        model = _llama(state, cross_entropy)
        top, layer = _tp_plan(sequence_parallel, lm_head)
        parallelize_module(model, mesh, top)
        for block in model.model.layers:
            parallelize_module(block, mesh, layer)
        losses = _train_llama(model, ids)
        results[name] = (losses, {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                                  for n, p in model.named_parameters()})
    return results


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    pytest.importorskip("transformers")
    import transformers
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(_llama_config()).state_dict()
    return state, gloo.spawn(_tp_runs, 2, tmp_path_factory.mktemp("tp"), state)


@pytest.mark.parametrize("run", list(_TP_RUNS))
def test_tensor_parallel_llama_trains_as_one_process(tp_results, run):
    state, results = tp_results
    got = results[run]
    _, cross_entropy, _ = _TP_RUNS[run]
    with one_thread():
        model = _llama(state, cross_entropy)
        losses = _train_llama(model, _llama_batch())
    tp_losses, tp_params = got
    for step, (a, b) in enumerate(zip(tp_losses, losses)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"step {step}: {run} {a} vs one process {b}"
    for name, p in model.named_parameters():
        assert_close(tp_params[name], p.detach(), GRAD_TOL[torch.float32], name)
