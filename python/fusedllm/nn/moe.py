"""The sparse mixture-of-experts layer (MoE) and its router and experts modules."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import functional as FF
from .._limits import ACTIVATIONS, check_positive_int
from ._common import _HF_ACTIVATIONS
from .mlp import GatedMLP

_MOE_SCORINGS = ("softmax", "sigmoid")


class MoERouter(nn.Module):
    """The router of :class:`MoE`: ``weight [num_experts, hidden_size]`` (and the
    ``e_score_correction_bias`` buffer with ``correction_bias=True``), named as
    in transformers' router modules. ``forward(x)`` gives the router logits."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        if correction_bias:
            self.e_score_correction_bias = nn.Buffer(torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MoEExperts(nn.Module):
    """The routed experts of :class:`MoE` as transformers stores them:
    ``gate_up_proj [num_experts, 2 * intermediate, hidden]`` (rows ``[gate |
    up]``) and ``down_proj [num_experts, hidden, intermediate]``.
    ``forward(x, indices, weights)`` is :func:`fusedllm.moe_experts`."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, activation: str = "silu",
                 device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return FF.moe_experts(x, indices, weights, self.gate_up_proj, self.down_proj, self.activation)


class MoE(nn.Module):
    """A sparse mixture-of-experts feed-forward layer (Mixtral, Qwen2/3-MoE,
    OLMoE, DeepSeek-V3) on :func:`fusedllm.moe_route` and
    :func:`fusedllm.moe_experts`.

    Each token's router logits ``gate(x)`` choose ``top_k`` of ``num_experts``
    gated MLPs (``act(gate) * up``, ``activation`` ``"silu"`` or
    ``"gelu_tanh"``); the output is their sum weighted by the router's
    scores. ``scoring`` ``"softmax"`` (over all experts) or ``"sigmoid"``
    (DeepSeek-V3); ``normalize`` divides the chosen scores by their sum
    (Mixtral always, ``norm_topk_prob`` elsewhere); ``scaling`` multiplies
    them (``routed_scaling_factor``); ``num_groups`` / ``top_groups`` restrict
    the choice to the best groups of experts and ``correction_bias=True`` adds
    the ``gate.e_score_correction_bias`` buffer to the scores for choosing
    only (both DeepSeek-V3). The routing weights stay float32 (float64 for
    float64 inputs) into the experts, as Mixtral's do; Qwen's and OLMoE's
    routers round them to the model dtype first, which only matters in half
    precision.

    ``shared_intermediate_size`` adds a shared expert every token goes
    through (a :class:`GatedMLP` of that width, stored as ``shared_name``:
    ``"shared_expert"`` as in Qwen2-MoE, ``"shared_experts"`` as in
    DeepSeek-V3); ``shared_gate=True`` scales it per token by
    ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE).

    Parameters are named as transformers 5 names them, so the state dict of
    a Hugging Face sparse MoE block loads unchanged: ``gate.weight``
    ``[num_experts, hidden]``, ``experts.gate_up_proj``
    ``[num_experts, 2 * intermediate, hidden]``, ``experts.down_proj``
    ``[num_experts, hidden, intermediate]`` (and ``gate.e_score_correction_bias``,
    ``shared_expert.*``, ``shared_expert_gate.weight``). :meth:`from_config`
    builds the layer a Hugging Face config describes.

    ``forward(x)`` takes ``[..., hidden_size]`` and returns the same shape.
    ``forward(x, return_router_logits=True)`` returns ``(out, router_logits,
    indices)``, the logits ``[tokens, num_experts]`` and chosen experts
    ``[tokens, top_k]`` (tokens = x's leading dims flattened), which is what
    :func:`fusedllm.moe_load_balancing_loss` takes for the auxiliary loss.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 activation: str = "silu", normalize: bool = True, scoring: str = "softmax",
                 num_groups: int = 1, top_groups: int | None = None, scaling: float = 1.0,
                 correction_bias: bool = False, *, shared_intermediate_size: int | None = None,
                 shared_gate: bool = False, shared_name: str = "shared_expert", device=None, dtype=None):
        super().__init__()
        owner = "fusedllm.nn.MoE"
        check_positive_int(owner, "hidden_size", hidden_size)
        check_positive_int(owner, "intermediate_size", intermediate_size)
        check_positive_int(owner, "num_experts", num_experts)
        check_positive_int(owner, "top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"{owner}: top_k ({top_k}) must be at most num_experts ({num_experts})")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{owner}: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if scoring not in _MOE_SCORINGS:
            raise ValueError(f"{owner}: scoring must be one of {_MOE_SCORINGS}, got {scoring!r}")
        for name, value in (("normalize", normalize), ("correction_bias", correction_bias),
                            ("shared_gate", shared_gate)):
            if not isinstance(value, bool):
                raise ValueError(f"{owner}: {name} must be True or False, got {value!r}")
        check_positive_int(owner, "num_groups", num_groups)
        if num_experts % num_groups:
            raise ValueError(f"{owner}: num_groups ({num_groups}) must divide num_experts ({num_experts})")
        top_groups = num_groups if top_groups is None else check_positive_int(owner, "top_groups", top_groups)
        if top_groups > num_groups:
            raise ValueError(f"{owner}: top_groups ({top_groups}) must be at most num_groups ({num_groups})")
        if top_k > top_groups * (num_experts // num_groups):
            raise ValueError(f"{owner}: top_k ({top_k}) is more than the {top_groups * (num_experts // num_groups)} "
                             f"experts of the top_groups={top_groups} groups kept")
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
            raise ValueError(f"{owner}: scaling must be a finite number, got {scaling!r}")
        if shared_intermediate_size is not None:
            check_positive_int(owner, "shared_intermediate_size", shared_intermediate_size)
        elif shared_gate:
            raise ValueError(f"{owner}: shared_gate=True needs a shared expert (shared_intermediate_size)")
        if not isinstance(shared_name, str) or not shared_name.isidentifier() or \
                shared_name in ("gate", "experts", "shared_expert_gate"):
            raise ValueError(f"{owner}: shared_name must be an identifier other than gate, experts and "
                             f"shared_expert_gate, got {shared_name!r}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.activation, self.normalize, self.scoring = activation, normalize, scoring
        self.num_groups, self.top_groups, self.scaling = num_groups, top_groups, float(scaling)
        self.shared_intermediate_size, self.shared_name = shared_intermediate_size, shared_name
        factory = {"device": device, "dtype": dtype}
        self.gate = MoERouter(hidden_size, num_experts, correction_bias, **factory)
        self.experts = MoEExperts(hidden_size, intermediate_size, num_experts, activation, **factory)
        self.shared_expert_gate = None
        if shared_intermediate_size is not None:
            setattr(self, shared_name, GatedMLP(hidden_size, shared_intermediate_size, activation=activation,
                                                **factory))
            if shared_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Router and expert weights uniform in ``±1/sqrt(fan_in)``, as
        ``nn.Linear`` starts its weights; the correction bias at zero."""
        bound_h, bound_i = self.hidden_size ** -0.5, self.intermediate_size ** -0.5
        with torch.no_grad():
            self.gate.weight.uniform_(-bound_h, bound_h)
            self.experts.gate_up_proj.uniform_(-bound_h, bound_h)
            self.experts.down_proj.uniform_(-bound_i, bound_i)
            if self.gate.e_score_correction_bias is not None:
                self.gate.e_score_correction_bias.zero_()
        shared = self.shared
        if shared is not None:
            for lin in (shared.gate_proj, shared.up_proj, shared.down_proj):
                lin.reset_parameters()
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.reset_parameters()

    @property
    def shared(self) -> "GatedMLP | None":
        """The shared expert, or None."""
        return None if self.shared_intermediate_size is None else getattr(self, self.shared_name)

    @classmethod
    def from_config(cls, config, device=None, dtype=None) -> "MoE":
        """The sparse MoE block a Hugging Face config describes: Mixtral
        (``num_local_experts``, ``intermediate_size``, always normalized),
        Qwen2-MoE (``moe_intermediate_size``, ``norm_topk_prob``, the shared
        expert of ``shared_expert_intermediate_size`` and its sigmoid gate),
        Qwen3-MoE (``moe_intermediate_size``), OLMoE (``intermediate_size``),
        DeepSeek-V3 (sigmoid scores, ``n_group`` / ``topk_group``,
        ``routed_scaling_factor``, the correction bias, ``n_shared_experts``
        shared experts). Other model types, and settings these layers have
        no kernel for, are a ValueError."""
        owner = "fusedllm.nn.MoE.from_config"
        model_type = getattr(config, "model_type", None)
        if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"):
            raise ValueError(f"{owner}: model type {model_type!r} is not one of mixtral, qwen2_moe, qwen3_moe, "
                             f"olmoe, deepseek_v3")
        act_name = getattr(config, "hidden_act", "silu")
        if act_name not in _HF_ACTIVATIONS:
            raise ValueError(f"{owner}: activation {act_name!r} has no fused kernel; supported: "
                             f"{sorted(_HF_ACTIVATIONS)}")
        common = {"activation": _HF_ACTIVATIONS[act_name], "device": device, "dtype": dtype}
        top_k = config.num_experts_per_tok
        if model_type == "mixtral":
            return cls(config.hidden_size, config.intermediate_size, config.num_local_experts, top_k,
                       normalize=True, **common)
        if model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):  # OLMoE's experts are intermediate_size wide
            inter = config.intermediate_size if model_type == "olmoe" else config.moe_intermediate_size
            shared = {}
            if model_type == "qwen2_moe":
                size = getattr(config, "shared_expert_intermediate_size", 0) or 0
                if size <= 0:
                    raise ValueError(f"{owner}: a Qwen2-MoE block always has a shared expert; "
                                     f"shared_expert_intermediate_size is {size!r}")
                shared = {"shared_intermediate_size": size, "shared_gate": True}
            return cls(config.hidden_size, inter, config.num_experts, top_k,
                       normalize=bool(config.norm_topk_prob), **shared, **common)
        if model_type == "deepseek_v3":
            n_shared = getattr(config, "n_shared_experts", 0) or 0
            shared = {"shared_intermediate_size": config.moe_intermediate_size * n_shared,
                      "shared_name": "shared_experts"} if n_shared else {}
            if getattr(config, "topk_method", "noaux_tc") not in ("noaux_tc", None):
                raise ValueError(f"{owner}: topk_method {config.topk_method!r} is not DeepSeek-V3's noaux_tc")
            return cls(config.hidden_size, config.moe_intermediate_size, config.n_routed_experts, top_k,
                       normalize=bool(config.norm_topk_prob), scoring="sigmoid",
                       num_groups=config.n_group or 1, top_groups=config.topk_group or None,
                       scaling=float(config.routed_scaling_factor), correction_bias=True, **shared, **common)
        raise AssertionError(model_type)

    def route(self, x: torch.Tensor):
        """``(router_logits [tokens, num_experts], weights, indices [tokens, top_k])`` for ``x [..., hidden]``."""
        logits = self.gate(x.reshape(-1, self.hidden_size))
        weights, indices = FF.moe_route(logits, self.top_k, self.scoring, self.normalize,
                                        self.gate.e_score_correction_bias, self.num_groups, self.top_groups,
                                        self.scaling)
        return logits, weights, indices

    def forward(self, x: torch.Tensor, return_router_logits: bool = False):
        owner = "fusedllm.nn.MoE"
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{owner}: x must be [..., hidden_size={self.hidden_size}], got {shape}")
        weight = self.gate.weight
        if x.dtype != weight.dtype or x.device != weight.device:
            raise ValueError(f"{owner}: x is {x.dtype} on {x.device} but the layer is {weight.dtype} on "
                             f"{weight.device}")
        flat = x.reshape(-1, self.hidden_size)
        logits, weights, indices = self.route(flat)
        out = self.experts(flat, indices, weights)
        shared = self.shared
        if shared is not None:
            extra = shared(flat)
            if self.shared_expert_gate is not None:
                extra = torch.sigmoid(self.shared_expert_gate(flat)) * extra
            out = out + extra
        out = out.view(x.shape)
        return (out, logits, indices) if return_router_logits else out

    def extra_repr(self) -> str:
        text = (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, activation='{self.activation}', "
                f"scoring='{self.scoring}', normalize={self.normalize}")
        if self.num_groups > 1:
            text += f", num_groups={self.num_groups}, top_groups={self.top_groups}"
        if self.scaling != 1.0:
            text += f", scaling={self.scaling}"
        if self.gate.e_score_correction_bias is not None:
            text += ", correction_bias=True"
        return text
