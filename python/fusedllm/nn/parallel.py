"""ParallelBlock, the decoder block with attention and the gated feed-forward in parallel, fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import functional as FF
from .._limits import ACTIVATIONS, check_positive_int, check_rotary_dim
from ._common import _attends_in_cache, _attention_options, _attention_repr, _head_layout, _sequence_input
from .attention import GQAttention
from .kv_cache import KVCache
from .mlp import GatedMLP
from .norm import RMSNorm
from .rope import RotaryEmbedding

# --- parallel attention + feed-forward block ------------------------------------------------

_PARALLEL_NORMS = ("rms", "layer")
# the separate projections a ParallelBlock's two weights hold, in their order
_IN_PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_OUT_PARTS = ("o_proj", "down_proj")


class ParallelBlock(nn.Module):
    """A pre-norm decoder block with attention and the gated feed-forward in
    parallel (PaLM, GPT-J): ``x + attn(norm(x)) + mlp(norm(x))``, fused.

    One matrix multiply produces q, k, v, gate and up together from the
    normalized input (``in_proj_weight`` is the row concatenation of the five
    projections' weights); q and k are rotated and attention runs on the
    fused ops, reading q, k and v as strided views of that product; the gated
    activation reads the ``[gate | up]`` slice in place. The output
    projection is one weight, ``out_proj_weight``, the column concatenation
    ``[o_proj | down_proj]``, applied to ``[attention output | gated hidden]``
    with the residual added in the same call (``addmm``), split along its
    inner dimension into two accumulating ``addmm`` calls so the two inputs
    are never copied into one tensor (at 4096 tokens, d_model 1024, that copy
    took the forward's peak memory from 172 to 268 MiB). Forward and backward.

    ``norm="rms"`` is :class:`RMSNorm`; ``norm="layer"`` is torch's
    ``nn.LayerNorm`` (with a bias when ``bias=True``). ``activation`` is
    ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU). ``n_kv_heads`` (default
    ``n_heads``) must divide ``n_heads``; ``head_dim`` defaults to
    ``d_model // n_heads``. ``rope=True`` rotates q and k with a
    :class:`RotaryEmbedding` (``rope_base``, ``rope_scaling``,
    ``rope_interleaved`` for GPT-J's pairing, ``rotary_dim`` for a partial
    rotation); ``window`` is a sliding window and ``dropout`` drops attention
    probabilities in training mode, as in :class:`GQAttention`.

    The state dict holds the separate projections, ``q_proj.weight``,
    ``k_proj.weight``, ``v_proj.weight``, ``gate_proj.weight``,
    ``up_proj.weight``, ``o_proj.weight``, ``down_proj.weight`` (and
    ``.bias`` with ``bias=True``) beside ``norm.weight``, so it loads from and
    into models that store them apart; ``load_state_dict`` also takes the
    fused names (``in_proj_weight`` ...). :meth:`from_sequential` builds one
    from a :class:`GQAttention` and a :class:`GatedMLP`. :meth:`projections`
    gives the five input and two output weights as views.

    ``forward(x, mask=None, position_offset=None, cache=None)`` takes and
    returns ``[batch, seq, d_model]``; ``mask``, ``cache`` (a
    :class:`KVCache`) and ``position_offset`` mean what they mean in
    :meth:`GQAttention.forward`.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 intermediate_size: int | None = None, norm: str = "rms", activation: str = "silu",
                 bias: bool = False, rope: bool = True, window: int | None = None, *,
                 head_dim: int | None = None, eps: float = 1e-6, dropout: float = 0.0,
                 rope_base: float = 10000.0, rope_scaling: dict | None = None,
                 rope_interleaved: bool = False, rotary_dim: int | None = None,
                 max_positions: int = 8192, device=None, dtype=None):
        super().__init__()
        owner = "fusedllm.nn.ParallelBlock"
        n_kv_heads, head_dim = _head_layout(owner, d_model, n_heads, n_kv_heads, head_dim)
        if intermediate_size is None:
            raise ValueError(f"{owner}: intermediate_size must be given (the gated hidden width)")
        check_positive_int(owner, "intermediate_size", intermediate_size)
        if norm not in _PARALLEL_NORMS:
            raise ValueError(f"{owner}: norm must be one of {_PARALLEL_NORMS}, got {norm!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{owner}: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if not isinstance(bias, bool):
            raise ValueError(f"{owner}: bias must be True or False, got {bias!r}")
        if not isinstance(rope, bool):
            raise ValueError(f"{owner}: rope must be True or False, got {rope!r}")
        if rope:
            if rotary_dim is None and head_dim % 2:
                raise ValueError(f"{owner}: rope=True needs an even head_dim, got {head_dim}")
            check_rotary_dim(owner, rotary_dim, head_dim)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"{owner}: eps must be a number >= 0, got {eps!r}")
        dropout = _attention_options(owner, dropout, window)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.intermediate_size = intermediate_size
        self.norm_kind, self.activation, self.window, self.dropout = norm, activation, window, dropout
        self.eps = float(eps)
        q_dim, kv_dim, f = n_heads * head_dim, n_kv_heads * head_dim, intermediate_size
        # rows of in_proj_weight, columns of out_proj_weight, per separate projection
        self._in_sizes = (q_dim, kv_dim, kv_dim, f, f)
        self._out_sizes = (q_dim, f)
        factory = {"device": device, "dtype": dtype}
        if norm == "rms":
            self.norm = RMSNorm(d_model, eps=self.eps, **factory)
        else:
            self.norm = nn.LayerNorm(d_model, eps=self.eps, bias=bias, **factory)
        self.in_proj_weight = nn.Parameter(torch.empty(sum(self._in_sizes), d_model, **factory))
        self.out_proj_weight = nn.Parameter(torch.empty(d_model, sum(self._out_sizes), **factory))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(sum(self._in_sizes), **factory))
            # one row per output projection: o_proj's bias and down_proj's
            self.out_proj_bias = nn.Parameter(torch.empty(2, d_model, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
            self.register_parameter("out_proj_bias", None)
        self.rotary = (RotaryEmbedding(head_dim, max_positions=max_positions, base=rope_base,
                                       scaling=rope_scaling, interleaved=rope_interleaved,
                                       rotary_dim=rotary_dim, device=device) if rope else None)
        self.reset_parameters()
        self.register_state_dict_post_hook(ParallelBlock._split_state_dict)
        self.register_load_state_dict_pre_hook(ParallelBlock._join_state_dict)

    def reset_parameters(self) -> None:
        """Each slice initialised as the ``nn.Linear`` it stands for."""
        if self.in_proj_weight.is_meta:
            return
        with torch.no_grad():
            views = self.projections()
            for name in (*_IN_PARTS, *_OUT_PARTS):
                weight = views[name + ".weight"]
                bound = 1.0 / weight.shape[1] ** 0.5  # kaiming_uniform(a=sqrt(5)) of nn.Linear
                weight.uniform_(-bound, bound)
                if name + ".bias" in views:
                    views[name + ".bias"].uniform_(-bound, bound)

    # --- the separate projections -------------------------------------------------------

    def projections(self) -> dict:
        """Views of ``in_proj_weight`` / ``out_proj_weight`` (and the biases) as
        the separate projections: ``{"q_proj.weight": ..., "down_proj.bias": ...}``.
        Writing into a view writes the block's parameter."""
        views = {}
        for name, part in zip(_IN_PARTS, self.in_proj_weight.split(self._in_sizes, 0)):
            views[name + ".weight"] = part
        for name, part in zip(_OUT_PARTS, self.out_proj_weight.split(self._out_sizes, 1)):
            views[name + ".weight"] = part
        if self.in_proj_bias is not None:
            for name, part in zip(_IN_PARTS, self.in_proj_bias.split(self._in_sizes, 0)):
                views[name + ".bias"] = part
            views["o_proj.bias"], views["down_proj.bias"] = self.out_proj_bias.unbind(0)
        return views

    @staticmethod
    def _split_state_dict(module, state_dict, prefix, local_metadata):
        for fused in ("in_proj_weight", "out_proj_weight", "in_proj_bias", "out_proj_bias"):
            state_dict.pop(prefix + fused, None)
        for name, view in module.projections().items():
            # separate tensors (a checkpoint of them loads anywhere, safetensors included)
            state_dict[prefix + name] = view.detach().clone(memory_format=torch.contiguous_format)

    @staticmethod
    def _join_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs):
        """Separate projections in ``state_dict`` become the fused entries."""
        has_bias = module.in_proj_bias is not None
        groups = [("in_proj_weight", _IN_PARTS, "weight", 0), ("out_proj_weight", _OUT_PARTS, "weight", 1)]
        if has_bias:
            groups += [("in_proj_bias", _IN_PARTS, "bias", 0), ("out_proj_bias", _OUT_PARTS, "bias", None)]
        for fused, parts, kind, dim in groups:
            keys = [f"{prefix}{name}.{kind}" for name in parts]
            present = [k for k in keys if k in state_dict]
            if not present or prefix + fused in state_dict:
                continue  # the fused name is used, or nothing is there: load_state_dict reports it
            if len(present) != len(keys):
                error_msgs.append(f"fusedllm.nn.ParallelBlock: {fused} needs all of "
                                  f"{[k[len(prefix):] for k in keys]}; missing "
                                  f"{[k[len(prefix):] for k in keys if k not in state_dict]}")
                for k in present:
                    state_dict.pop(k)
                continue
            tensors = [state_dict.pop(k) for k in keys]
            expected = module.projections()
            for key, tensor in zip(keys, tensors):
                want = expected[key[len(prefix):]].shape
                if tuple(tensor.shape) != tuple(want):
                    error_msgs.append(f"fusedllm.nn.ParallelBlock: {key} has shape {list(tensor.shape)}, "
                                      f"this block needs {list(want)}")
                    break
            else:
                state_dict[prefix + fused] = torch.stack(tensors) if dim is None else torch.cat(tensors, dim)
        if not has_bias:
            stray = [f"{prefix}{name}.bias" for name in (*_IN_PARTS, *_OUT_PARTS) if f"{prefix}{name}.bias" in state_dict]
            if stray:
                error_msgs.append(f"fusedllm.nn.ParallelBlock: the state dict has biases ({stray[0][len(prefix):]}, ...) "
                                  f"but this block was built with bias=False")
                for k in stray:
                    state_dict.pop(k)

    @classmethod
    def from_sequential(cls, attention: "GQAttention", mlp: "GatedMLP", norm: nn.Module | None = None,
                        **kwargs) -> "ParallelBlock":
        """A block computing ``x + attention(norm(x)) + mlp(norm(x))`` with copies
        of the weights of a :class:`GQAttention`, a :class:`GatedMLP` and a norm
        (:class:`RMSNorm` or ``nn.LayerNorm``; default a new RMSNorm). Options
        not taken from the modules (``rope_base`` ...) go in ``kwargs``."""
        owner = "fusedllm.nn.ParallelBlock.from_sequential"
        if not isinstance(attention, GQAttention):
            raise ValueError(f"{owner}: attention must be a fusedllm.nn.GQAttention, got {type(attention).__name__}")
        if not isinstance(mlp, GatedMLP):
            raise ValueError(f"{owner}: mlp must be a fusedllm.nn.GatedMLP, got {type(mlp).__name__}")
        if mlp.gate_proj.in_features != attention.d_model:
            raise ValueError(f"{owner}: mlp takes {mlp.gate_proj.in_features} features but attention's "
                             f"d_model is {attention.d_model}")
        bias = attention.q_proj.bias is not None
        if (mlp.gate_proj.bias is not None) != bias:
            raise ValueError(f"{owner}: attention and mlp must both have biases or both have none")
        if norm is not None and not isinstance(norm, (RMSNorm, nn.LayerNorm)):
            raise ValueError(f"{owner}: norm must be a fusedllm.nn.RMSNorm or nn.LayerNorm, got {type(norm).__name__}")
        if isinstance(norm, RMSNorm) and (norm.offset or norm.casting != "llama" or norm.weight is None):
            raise ValueError(f"{owner}: norm must be a plain RMSNorm (offset 0, llama casting, with a weight)")
        kind = "layer" if isinstance(norm, nn.LayerNorm) else "rms"
        if norm is not None:
            kwargs.setdefault("eps", norm.eps)
        rotary = attention.rotary
        if rotary is not None:
            kwargs.setdefault("rope_base", rotary.base)
            kwargs.setdefault("rope_scaling", rotary.scaling)
            kwargs.setdefault("rope_interleaved", rotary.interleaved)
            kwargs.setdefault("rotary_dim", rotary.rotary_dim)
        weight = attention.q_proj.weight
        block = cls(attention.d_model, attention.n_heads, attention.n_kv_heads, mlp.gate_proj.out_features,
                    norm=kind, activation=mlp.activation, bias=bias, rope=rotary is not None,
                    window=attention.window, head_dim=attention.head_dim, dropout=attention.dropout,
                    device=weight.device, dtype=weight.dtype, **kwargs)
        state = {f"{name}.{kind_}": getattr(getattr(module, name), kind_)
                 for module, names in ((attention, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                       (mlp, ("gate_proj", "up_proj", "down_proj")))
                 for name in names for kind_ in (("weight", "bias") if bias else ("weight",))}
        state.update({f"norm.{k}": v for k, v in (norm or block.norm).state_dict().items()})
        block.load_state_dict({k: v.detach() for k, v in state.items()})
        return block

    # --- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, position_offset: int | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        owner = "fusedllm.nn.ParallelBlock"
        position_offset = _sequence_input(owner, x, self.d_model, cache, position_offset)
        weight = self.in_proj_weight
        if x.dtype != weight.dtype or x.device != weight.device:
            raise ValueError(f"{owner}: x is {x.dtype} on {x.device} but the block's parameters are "
                             f"{weight.dtype} on {weight.device}; move one to the other (block.to(...))")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise ValueError(f"{owner}: mask must be a torch.Tensor or None, got {type(mask).__name__}")
        batch, seq, _ = x.shape
        heads, kv_heads, d = self.n_heads, self.n_kv_heads, self.head_dim
        q_dim, kv_dim, _, f, _ = self._in_sizes
        # one GEMM: [q | k | v | gate | up]; every piece below is a strided view of it.
        # split (not four slices): its backward writes the four gradients into one
        # tensor with one cat, where slices would each fill a zero tensor of the
        # whole projection's size and add them up.
        proj = F.linear(self.norm(x), self.in_proj_weight, self.in_proj_bias)
        q, k, v, gate_up = proj.split((q_dim, kv_dim, kv_dim, 2 * f), dim=-1)
        q = q.view(batch, seq, heads, d).transpose(1, 2)
        k = k.view(batch, seq, kv_heads, d).transpose(1, 2)
        v = v.view(batch, seq, kv_heads, d).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, k, position_offset=position_offset)
        dropout_p = self.dropout if self.training else 0.0
        if _attends_in_cache(owner, cache, False):
            attn = cache.attend(q, k, v, window=self.window, dropout_p=dropout_p, mask=mask)
        else:
            if cache is not None:
                k, v = cache.append(k, v)
            attn = FF.attention(q, k, v, causal=True, window=self.window, mask=mask, dropout_p=dropout_p)
        del q, k, v
        hidden = FF.swiglu(gate_up, activation=self.activation)
        del gate_up, proj  # without autograd the projection's memory is free from here
        # The output projection [o_proj | down_proj] as one addmm over the K split:
        # attention's columns, then the hidden's accumulated onto them, the
        # residual added by the first. The same products as one GEMM over
        # [attention | hidden], without copying the two into one tensor.
        residual = x.reshape(batch * seq, self.d_model)
        if self.out_proj_bias is not None:
            residual = residual + self.out_proj_bias.sum(0)
        w_o, w_down = self.out_proj_weight.split(self._out_sizes, dim=1)
        out = torch.addmm(residual, attn.transpose(1, 2).reshape(batch * seq, q_dim), w_o.t())
        out = torch.addmm(out, hidden.view(batch * seq, f), w_down.t())
        return out.view(batch, seq, self.d_model)

    def extra_repr(self) -> str:
        return _attention_repr(self, f"intermediate_size={self.intermediate_size}, norm='{self.norm_kind}', "
                                     f"activation='{self.activation}', bias={self.in_proj_bias is not None}")
