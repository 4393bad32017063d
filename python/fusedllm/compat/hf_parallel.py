"""Hugging Face parallel-residual decoder layers on the fused ops, built by
:func:`fusedllm.patch` from a model's own layers.

A parallel layer computes ``x + attn(norm(x)) + mlp(norm'(x))``. The fused
layer keeps the original norms (torch's ``nn.LayerNorm``, Cohere's
mean-centred ``CohereLayerNorm``: fusedllm has no LayerNorm kernel) and
activation modules, and runs:

- the input projections as one matrix multiply where attention and MLP read
  the same normalized input (GPT-J, Cohere: q, k, v and the MLP's input
  projection(s) together; GPT-NeoX normalizes twice, so its two stay apart),
  on weights concatenated at call time from ``_PACKED_MIN_TOKENS`` tokens
  on, so the parameters stay the model's own ``nn.Linear`` modules;
- RoPE (fusedllm ``rope``: GPT-J's interleaved partial rotation from its
  sin/cos table, NeoX's partial half-split and Cohere's interleaved pairs
  from the model's per-token tables) and attention (fusedllm ``attention``
  through :func:`fusedllm.hf.attention_forward`, so masks, caches and
  dropout mean what they mean there);
- Cohere's gated MLP with the fused SwiGLU on the ``[gate | up]`` slice;
- the output projections as one product of ``[attention | MLP hidden]`` with
  ``[o_proj | down_proj]``, two accumulating ``addmm`` calls on the model's
  own weights, the residual (and biases) added in the first.

Each fused layer is an instance of a subclass of the original layer class
(so transformers' output hooks still find it) holding the very same
submodules; where it cannot run fused (attention weights asked for, residual
dropout active in training) it calls the original forward.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .. import functional as FF
from ..nn.mlp import _PACKED_MIN_TOKENS

_CLASSES: dict = {}


def _joint_linear(x: torch.Tensor, linears, pack_last: bool = False) -> list:
    """Each ``linear(x)``, from one matrix multiply on the concatenated weights
    when ``x`` has enough tokens (the outputs are then views of one product).
    ``pack_last``: the last two outputs come as one ``[a | b]`` view when they
    share a product, else as the pair ``(a, b)``."""
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if len(linears) == 1 or tokens < _PACKED_MIN_TOKENS:
        outs = [lin(x) for lin in linears]
        return outs[:-2] + [(outs[-2], outs[-1])] if pack_last else outs
    weight = torch.cat([lin.weight for lin in linears], 0)
    if all(lin.bias is None for lin in linears):
        bias = None
    else:
        bias = torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                          for lin in linears])
    sizes = [lin.out_features for lin in linears]
    if pack_last:
        sizes = sizes[:-2] + [sizes[-2] + sizes[-1]]
    return list(F.linear(x, weight, bias).split(sizes, -1))


def _joint_output(attn: torch.Tensor, hidden: torch.Tensor, o_proj: nn.Linear, down_proj: nn.Linear,
                  residual: torch.Tensor) -> torch.Tensor:
    """``residual + o_proj(attn) + down_proj(hidden)``: the product of
    ``[attn | hidden]`` with ``[o_proj | down_proj]`` as two ``addmm`` calls
    accumulating into one output (the inner dimension split where the two
    weights meet), the residual and biases added by the first. Neither the
    activations nor the weights are copied into one tensor."""
    shape = residual.shape
    base = residual.reshape(-1, shape[-1])
    for lin in (o_proj, down_proj):
        if lin.bias is not None:
            base = base + lin.bias
    out = torch.addmm(base, attn.reshape(-1, attn.shape[-1]), o_proj.weight.t())
    out = torch.addmm(out, hidden.reshape(-1, hidden.shape[-1]), down_proj.weight.t())
    return out.view(shape)


def _heads(t: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """``[B, S, H * D]`` (maybe a strided slice) as a ``[B, H, S, D]`` view."""
    return t.unflatten(-1, (heads, head_dim)).transpose(1, 2)


def _attend(attn_module, q, k, v, mask, cache, dropout):
    from .. import hf

    if cache is not None:
        k, v = cache.update(k, v, attn_module.layer_idx)
    out, _ = hf.attention_forward(attn_module, q, k, v, mask, scaling=q.shape[-1] ** -0.5,
                                  dropout=dropout if attn_module.training else 0.0)
    return out.flatten(2)  # [B, S, H * D]


# --- the three layer kinds ------------------------------------------------------------------

class _FusedCohereLayer:
    """Cohere: one CohereLayerNorm; q, k, v, gate, up in one GEMM; interleaved RoPE
    from the model's per-token tables; fused attention and SwiGLU; one output GEMM."""

    FUSED = "one input GEMM (q, k, v, gate, up), fused RoPE, attention and SwiGLU, one output GEMM with the residual"

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, position_embeddings=None, **kwargs):
        attn, mlp = self.self_attn, self.mlp
        if kwargs.get("output_attentions") or position_embeddings is None:
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, use_cache=use_cache,
                                   position_embeddings=position_embeddings, **kwargs)
        normed = self.input_layernorm(hidden_states)
        q, k, v, gate_up = _joint_linear(normed, [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj,
                                                  mlp.up_proj], pack_last=True)
        d = attn.head_dim
        q, k, v = _heads(q, q.shape[-1] // d, d), _heads(k, k.shape[-1] // d, d), _heads(v, v.shape[-1] // d, d)
        cos, sin = position_embeddings
        q, k = FF.apply_rope(q, k, cos, sin, interleaved=True, rotary_dim=cos.shape[-1])
        out = _attend(attn, q, k, v, attention_mask, past_key_values, attn.attention_dropout)
        if isinstance(gate_up, tuple):
            hidden = FF.swiglu(*gate_up, activation=self._activation)
        else:  # the [gate | up] slice of the joint product, read in place
            hidden = FF.swiglu(gate_up, activation=self._activation)
        return _joint_output(out, hidden, attn.o_proj, mlp.down_proj, hidden_states)


class _FusedGPTJBlock:
    """GPT-J: one LayerNorm; q, k, v and fc_in in one GEMM; GPT-J's interleaved
    partial RoPE from its sin/cos table; fused attention; torch's GELU; one
    output GEMM over [attention | GELU(fc_in)] against [out_proj | fc_out].

    Two transformers layouts: up to 5.23 the block takes ``layer_past``, reads
    the attention's sin/cos table at ``position_ids`` and returns a tuple; from
    5.24 it takes ``cache`` and the model's per-token ``position_embeddings``
    (sin, cos) and returns the hidden states."""

    FUSED = "one input GEMM (q, k, v, fc_in), fused RoPE and attention, one output GEMM with the residual"

    def forward(self, hidden_states, layer_past=None, attention_mask=None, position_ids=None, use_cache=False,
                output_attentions=False, cache=None, position_embeddings=None, **kwargs):
        attn, mlp = self.attn, self.mlp
        per_token = position_embeddings is not None
        dropping = self.training and (attn.resid_dropout.p > 0 or mlp.dropout.p > 0)
        rotary = per_token or (position_ids is not None and hasattr(attn, "embed_positions"))
        if output_attentions or dropping or not rotary or attn.rotary_dim is None:
            passed = dict(attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, **kwargs)
            if per_token or cache is not None:
                passed.update(cache=cache, position_embeddings=position_embeddings)
            else:
                passed.update(layer_past=layer_past, output_attentions=output_attentions)
            return super().forward(hidden_states, **passed)
        normed = self.ln_1(hidden_states)
        q, k, v, up = _joint_linear(normed, [attn.q_proj, attn.k_proj, attn.v_proj, mlp.fc_in])
        heads, d = attn.num_attention_heads, attn.head_dim
        q, k, v = _heads(q, heads, d), _heads(k, heads, d), _heads(v, heads, d)
        # GPT-J's tables hold rotary_dim / 2 angles: fusedllm's layout, per token or per position
        if per_token:
            sin, cos = position_embeddings
            q, k = FF.apply_rope(q, k, cos, sin, interleaved=True, rotary_dim=attn.rotary_dim)
        else:
            table = attn.embed_positions
            if table.device != q.device:
                table = table.to(q.device)
            half = attn.rotary_dim // 2  # [positions, sin | cos]
            q, k = FF.apply_rope(q, k, table[:, half:], table[:, :half], position_ids=position_ids,
                                 interleaved=True, rotary_dim=attn.rotary_dim)
        dropout = attn.attention_dropout if hasattr(attn, "attention_dropout") else attn.attn_dropout.p
        out = _attend(attn, q, k, v, attention_mask, cache if per_token else layer_past, dropout)
        hidden = mlp.act(up)
        out = _joint_output(out, hidden, attn.out_proj, mlp.fc_out, hidden_states)
        return out if per_token else (out, None)


class _FusedGPTNeoXLayer:
    """GPT-NeoX / Pythia with ``use_parallel_residual``: two LayerNorms, so the
    input projections stay two GEMMs; NeoX's partial half-split RoPE from the
    model's per-token tables; fused attention on strided views of the packed
    per-head [q | k | v]; torch's GELU; one output GEMM over [attention | GELU
    hidden] against [dense | dense_4h_to_h] with the residual."""

    FUSED = "fused RoPE and attention, one output GEMM with the residual (two LayerNorms: two input GEMMs)"

    def forward(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False, layer_past=None,
                position_embeddings=None, **kwargs):
        attn, mlp = self.attention, self.mlp
        dropping = self.training and (self.post_attention_dropout.p > 0 or self.post_mlp_dropout.p > 0)
        if kwargs.get("output_attentions") or dropping or position_embeddings is None:
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache, layer_past=layer_past,
                                   position_embeddings=position_embeddings, **kwargs)
        d = attn.head_size
        qkv = attn.query_key_value(self.input_layernorm(hidden_states))
        qkv = qkv.unflatten(-1, (qkv.shape[-1] // (3 * d), 3 * d)).transpose(1, 2)  # [B, H, S, 3D]
        q, k, v = qkv.split(d, -1)
        cos, sin = position_embeddings
        q, k = FF.apply_rope(q, k, cos, sin, rotary_dim=cos.shape[-1])
        out = _attend(attn, q, k, v, attention_mask, layer_past, attn.attention_dropout)
        hidden = mlp.act(mlp.dense_h_to_4h(self.post_attention_layernorm(hidden_states)))
        return _joint_output(out, hidden, attn.dense, mlp.dense_4h_to_h, hidden_states)


_MIXINS = {"CohereDecoderLayer": _FusedCohereLayer, "GPTJBlock": _FusedGPTJBlock,
           "GPTNeoXLayer": _FusedGPTNeoXLayer}
PARALLEL_LAYERS = tuple(_MIXINS) + ("FalconDecoderLayer",)


def _fused_class(original_cls, mixin):
    key = (original_cls, mixin)
    if key not in _CLASSES:
        name = "Fused" + original_cls.__name__
        _CLASSES[key] = type(name, (mixin, original_cls), {"__module__": __name__, "__qualname__": name})
    return _CLASSES[key]


def _is_linear(m):
    return isinstance(m, nn.Linear)


def _problem(layer) -> str | None:
    """Why ``layer`` cannot run fused, or None."""
    name = type(layer).__name__
    if name == "FalconDecoderLayer":
        return ("Falcon's attention runs its own code (ALiBi option, multi-query / grouped query_key_value "
                "layouts) rather than transformers' AttentionInterface, and its MLP is an ungated GELU; "
                "left as it is")
    if name == "CohereDecoderLayer":
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if getattr(attn, "use_qk_norm", False):
            return "use_qk_norm (per-head LayerNorm of q and k) has no fused path; left as it is"
        if not all(_is_linear(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "expected nn.Linear q_proj / k_proj / v_proj / o_proj"
        if not all(_is_linear(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")):
            return "expected nn.Linear gate_proj / up_proj / down_proj"
        if type(mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
            return f"activation {type(mlp.act_fn).__name__} has no fused kernel"
        return None
    if name == "GPTJBlock":
        attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
        if type(attn).__name__ != "GPTJAttention":
            return f"attention class {type(attn).__name__} (only GPTJAttention, the eager one, is fused)"
        if not attn.rotary_dim:
            return "rotary_dim=None (GPT-J's table then spans the model width, not a head)"
        if not all(_is_linear(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "out_proj")):
            return "expected nn.Linear q_proj / k_proj / v_proj / out_proj"
        if not (_is_linear(getattr(mlp, "fc_in", None)) and _is_linear(getattr(mlp, "fc_out", None))):
            return "expected nn.Linear fc_in / fc_out"
        return None
    if name == "GPTNeoXLayer":
        if not getattr(layer, "use_parallel_residual", False):
            return ("use_parallel_residual=False: a sequential layer (its attention still runs fused through "
                    "the 'fusedllm' attention backend)")
        attn = getattr(layer, "attention", None)
        if not (_is_linear(getattr(attn, "query_key_value", None)) and _is_linear(getattr(attn, "dense", None))):
            return "expected nn.Linear query_key_value / dense"
        return None
    return f"{name} is not a parallel layer fusedllm knows"


def kept_modules(layer) -> list[tuple[str, str, str]]:
    """(attribute path, class, why) of what a fused layer keeps as torch's."""
    name = type(layer).__name__
    kept = []
    norms = {"CohereDecoderLayer": ("input_layernorm",), "GPTJBlock": ("ln_1",),
             "GPTNeoXLayer": ("input_layernorm", "post_attention_layernorm")}[name]
    for attr in norms:
        kept.append((attr, type(getattr(layer, attr)).__name__,
                     "kept: fusedllm has no LayerNorm kernel (the model's own module runs)"))
    if name == "GPTJBlock":
        kept.append(("mlp.act", type(layer.mlp.act).__name__, "kept: an ungated activation (the model's own module runs)"))
    if name == "GPTNeoXLayer":
        kept.append(("mlp.act", type(layer.mlp.act).__name__, "kept: an ungated activation (the model's own module runs)"))
    return kept


def fused_parallel_layer(layer):
    """The fused twin of a Hugging Face parallel-residual decoder layer, holding
    its very submodules, or a sentence saying why there is none."""
    problem = _problem(layer)
    if problem is not None:
        return problem
    cls = _fused_class(type(layer), _MIXINS[type(layer).__name__])
    new = cls.__new__(cls)
    # the same submodules, parameters, buffers and settings; dicts of its own
    new.__dict__.update({key: (copy.copy(value) if isinstance(value, dict) else value)
                         for key, value in layer.__dict__.items()})
    if isinstance(new, _FusedCohereLayer):
        new._activation = "silu"
    return new
