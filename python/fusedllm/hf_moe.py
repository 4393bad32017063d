"""Hugging Face sparse mixture-of-experts layers on :func:`fusedllm.moe_route`
and :func:`fusedllm.moe_experts`.

Two ways in:

- ``experts_implementation="fusedllm"``: :func:`experts_forward` is
  registered with transformers' ``ExpertsInterface``, so every experts class
  decorated with ``@use_experts_implementation`` (Mixtral, Qwen2/3-MoE,
  OLMoE, DeepSeek-V3, gpt-oss, ...) can run its experts through the fused
  op (gpt-oss's biases, weights stored transposed, interleaved gate/up
  columns and clamped SwiGLU included)::

      model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="fusedllm")
      model.set_experts_implementation("fusedllm")   # or switch an existing model

  Registration happens with ``attn_implementation="fusedllm"``'s (see
  :mod:`fusedllm.hf`), as soon as transformers' modeling code is imported
  after ``import fusedllm``. The router stays the model's own.

- ``fusedllm.patch(model)`` (``moe=True``) replaces the sparse MoE blocks of
  Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and gpt-oss
  (``GptOssMLP``, whose router has a bias and is called ``router``) by fused twins
  (:func:`fused_moe_block`): the block keeps its class's forward (Mixtral's
  router jitter, Qwen2-MoE's shared expert and its sigmoid gate, DeepSeek's
  shared experts all run as they do), with its router and experts replaced
  by instances of subclasses of their own classes whose forwards are
  ``moe_route`` and ``moe_experts``. The subclasses keep transformers'
  output hooks (``output_router_logits`` records the fused router's logits)
  and the very same ``Parameter`` objects, so state dicts and optimizers are
  unchanged.

This module does not import transformers until a function needs it.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import functional as FF
from ._limits import accumulation_dtype

NAME = "fusedllm"

# --- the experts ------------------------------------------------------------------------------


def experts_activation(act) -> str | None:
    """The fused activation equal to a transformers ``act_fn`` module (of an
    experts module or an MLP), or None."""
    name = type(act).__name__
    if name == "SiLUActivation" or isinstance(act, nn.SiLU):
        return "silu"
    # GELUTanh (gelu_pytorch_tanh, also with use_gelu_tanh_python) and
    # NewGELUActivation (gelu_new) are both the tanh approximation
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh"):
        return "gelu_tanh"
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        return "gelu_tanh"
    return None


def _gpt_oss_apply_gate():
    """GptOssExperts._apply_gate, or None in a transformers without gpt-oss."""
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return None
    return GptOssExperts.__dict__.get("_apply_gate")


def experts_settings(experts: nn.Module) -> dict | str:
    """The :func:`fusedllm.moe_experts` arguments that run ``experts`` (a
    transformers experts module) beyond hidden, indices and weights, or a
    sentence saying why none do."""
    if not getattr(experts, "has_gate", True):
        return "its experts are not gated (has_gate=False: up_proj, no gate_up_proj)"
    if getattr(experts, "has_post_expert_norm", False):
        return "it normalizes each expert's output (has_post_expert_norm)"
    if getattr(experts, "_is_expert_parallel", False):
        return "its experts are split across processes (expert parallelism)"
    transposed = bool(getattr(experts, "is_transposed", False))
    interleaved = not getattr(experts, "is_concatenated", True)
    settings = {"transposed": transposed, "interleaved": interleaved}
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is not None and apply_gate is _gpt_oss_apply_gate():
        # gpt-oss's clamped SwiGLU on interleaved gate/up columns
        limit, alpha = getattr(experts, "limit", None), getattr(experts, "alpha", None)
        if not interleaved:
            return "GptOssExperts' gating reads interleaved gate/up columns but is_concatenated=True"
        if not (isinstance(limit, (int, float)) and isinstance(alpha, (int, float)) and limit > 0
                and math.isfinite(alpha)):
            return f"swiglu_limit={limit!r} / swiglu_alpha={alpha!r} are not a positive limit and a finite alpha"
        settings.update(activation="gpt_oss", alpha=float(alpha), limit=float(limit))
    else:
        if apply_gate is not None:
            from transformers.integrations.moe import _default_apply_gate

            if apply_gate is not _default_apply_gate:
                return f"{type(experts).__name__} has its own gating (_apply_gate)"
        if interleaved:  # the default gate splits [gate | up] halves
            return "its gate_up_proj interleaves gate and up rows (is_concatenated=False), not [gate | up]"
        act = getattr(experts, "act_fn", None)
        activation = experts_activation(act)
        if activation is None:
            return (f"activation {type(act).__name__} has no fused kernel (silu, gelu_pytorch_tanh and gelu_new "
                    f"have)")
        settings["activation"] = activation
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    ok = isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3 \
        and down.dim() == 3 and gate_up.shape[0] == down.shape[0]
    if ok and transposed:
        ok = gate_up.shape[2] == 2 * down.shape[1] and gate_up.shape[1] == down.shape[2]
    elif ok:
        ok = gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
    if not ok:
        return ("expected gate_up_proj [experts, hidden, 2 * intermediate] and down_proj [experts, intermediate, "
                "hidden] (is_transposed)" if transposed else
                "expected gate_up_proj [experts, 2 * intermediate, hidden] and down_proj "
                "[experts, hidden, intermediate]")
    if getattr(experts, "has_bias", False):
        b1, b2 = getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None)
        count, hidden = gate_up.shape[0], down.shape[2] if transposed else down.shape[1]
        two_inter = gate_up.shape[2] if transposed else gate_up.shape[1]
        if not (isinstance(b1, torch.Tensor) and isinstance(b2, torch.Tensor)
                and tuple(b1.shape) == (count, two_inter) and tuple(b2.shape) == (count, hidden)):
            return "has_bias but no gate_up_proj_bias [experts, 2 * intermediate] and down_proj_bias [experts, hidden]"
    return settings


def experts_problem(experts: nn.Module) -> str | None:
    """Why ``experts`` (a transformers experts module) cannot run on
    :func:`fusedllm.moe_experts`, or None."""
    settings = experts_settings(experts)
    return settings if isinstance(settings, str) else None


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts contract on :func:`fusedllm.moe_experts`:
    ``hidden_states [tokens, hidden]``, ``top_k_index`` / ``top_k_weights``
    ``[tokens, top_k]`` -> ``[tokens, hidden]`` in ``hidden_states``' dtype.

    The routing weights are used in the dtype they come in where the op takes
    it (Mixtral's routers give float32, Qwen's and OLMoE's the model dtype);
    otherwise they are converted to the hidden dtype. Hidden states of
    another dtype than the expert weights (autocast) are converted to the
    weights' dtype, and the result back. gpt-oss's experts (biases, weights
    stored transposed, interleaved gate/up columns, its clamped SwiGLU) run
    as they are. What the op has no kernel for (ungated experts, another
    custom gate, a post-expert norm, expert parallelism, other activations)
    is a ValueError naming the experts class."""
    settings = experts_settings(self)
    if isinstance(settings, str):
        raise ValueError(f"fusedllm: experts_implementation='{NAME}' cannot run {type(self).__name__}: {settings}; "
                         f"use experts_implementation='eager' (or 'grouped_mm') for this model")
    weight_dtype = self.gate_up_proj.dtype
    x = hidden_states if hidden_states.dtype == weight_dtype else hidden_states.to(weight_dtype)
    accumulate = accumulation_dtype(x)
    weights = top_k_weights
    if weights.dtype not in (x.dtype, accumulate):
        weights = weights.to(x.dtype)
    biases = {}
    if getattr(self, "has_bias", False):
        biases = {"gate_up_bias": self.gate_up_proj_bias, "down_bias": self.down_proj_bias}
    activation = settings["activation"]
    options = {k: v for k, v in settings.items() if k != "activation"}
    out = FF.moe_experts(x, top_k_index, weights, self.gate_up_proj, self.down_proj, activation, **biases,
                         **options)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


# --- the routers ------------------------------------------------------------------------------

class _FusedRouter:
    """Mixin of a fused router: ``forward(hidden)`` returns ``(router_logits,
    weights, indices)`` as transformers' top-k routers do, from
    :func:`fusedllm.moe_route`. The routing settings are read from the
    original router when the twin is built (``_fusedllm_route``)."""

    def forward(self, hidden_states):
        r = self._fusedllm_route
        hidden = hidden_states.reshape(-1, self.weight.shape[1])
        if r["float32_logits"]:  # DeepSeek-V3 scores in float32 whatever the model dtype
            logits = F.linear(hidden.float(), self.weight.float())
        else:  # gpt-oss's router has a bias
            logits = F.linear(hidden, self.weight, self.bias if r["router_bias"] else None)
        bias = getattr(self, "e_score_correction_bias", None) if r["scoring"] == "sigmoid" else None
        weights, indices = FF.moe_route(logits, r["top_k"], r["scoring"], r["normalize"], bias,
                                        r["num_groups"], r["top_groups"], r["scaling"])
        if r["weights_in_logits_dtype"]:
            weights = weights.to(logits.dtype)
        return logits, weights, indices


class _FusedExperts:
    """Mixin of fused experts: forward is :func:`experts_forward`, whatever
    ``config._experts_implementation`` says."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)


class _FusedBlock:
    """Mixin of a fused sparse MoE block: the block class's own forward,
    running on the fused router and experts it holds."""


# sparse MoE block class -> routing family (the block holds `gate`, the router, and `experts`)
MOE_BLOCKS = {
    "MixtralSparseMoeBlock": "mixtral",
    "Qwen2MoeSparseMoeBlock": "qwen",
    "Qwen3MoeSparseMoeBlock": "qwen",
    "OlmoeSparseMoeBlock": "qwen",
    "DeepseekV3MoE": "deepseek_v3",
    "GptOssMLP": "gpt_oss",
}
_ROUTERS = {"mixtral": "MixtralTopKRouter", "qwen": ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter"),
            "deepseek_v3": "DeepseekV3TopkRouter", "gpt_oss": "GptOssTopKRouter"}


def router_name(family: str) -> str:
    """The attribute of a block of ``family`` holding its router (gpt-oss's is `router`)."""
    return "router" if family == "gpt_oss" else "gate"

_CLASSES: dict = {}


def _twin_class(original_cls, mixin):
    key = (original_cls, mixin)
    if key not in _CLASSES:
        name = "Fused" + original_cls.__name__
        _CLASSES[key] = type(name, (mixin, original_cls), {"__module__": __name__, "__qualname__": name})
    return _CLASSES[key]


def _twin(module, mixin, **attrs):
    """An instance of a subclass of ``module``'s class (with ``mixin`` first)
    sharing its parameters, buffers, submodules and hooks; dicts of its own."""
    cls = _twin_class(type(module), mixin)
    new = cls.__new__(cls)
    new.__dict__.update({key: (copy.copy(value) if isinstance(value, dict) else value)
                         for key, value in module.__dict__.items()})
    new.__dict__.update(attrs)
    return new


def _route_settings(router, family) -> dict | str:
    """The moe_route arguments ``router`` means, or why it has none."""
    expected = _ROUTERS[family]
    expected = (expected,) if isinstance(expected, str) else expected
    if type(router).__name__ not in expected:
        return f"router {type(router).__name__} is not {' / '.join(expected)}"
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return "expected a router `weight` [num_experts, hidden]"
    experts, top_k = weight.shape[0], getattr(router, "top_k", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        return f"router top_k {top_k!r} is not in [1, {experts}]"
    settings = {"top_k": top_k, "scoring": "softmax", "normalize": True, "num_groups": 1, "top_groups": 1,
                "scaling": 1.0, "float32_logits": False, "weights_in_logits_dtype": False, "router_bias": False}
    if family == "gpt_oss":
        # logits with the router's bias, softmax over the top-k logits in their dtype: moe_route's
        # softmax over all experts renormalized over the chosen ones (tests/test_moe.py)
        bias = getattr(router, "bias", None)
        if not (isinstance(bias, torch.Tensor) and tuple(bias.shape) == (experts,)):
            return f"expected a router `bias` [{experts}]"
        settings.update(router_bias=True, weights_in_logits_dtype=True)
    elif family == "qwen":
        settings["normalize"] = bool(router.norm_topk_prob)
        settings["weights_in_logits_dtype"] = True
    elif family == "deepseek_v3":
        groups, top_groups = router.num_group or 1, router.topk_group or 1
        if experts % groups or not 1 <= top_groups <= groups:
            return f"n_group={groups} / topk_group={top_groups} do not split {experts} experts into groups"
        if top_k > top_groups * (experts // groups):
            return f"top_k={top_k} is more than the experts of the topk_group={top_groups} groups"
        settings.update(scoring="sigmoid", normalize=bool(router.norm_topk_prob), num_groups=groups,
                        top_groups=top_groups, scaling=float(router.routed_scaling_factor), float32_logits=True)
    return settings


def fused_moe_block(block: nn.Module):
    """The fused twin of a Hugging Face sparse MoE block (a subclass of its
    class holding the same submodules, with a fused router and fused
    experts), or a sentence saying why there is none."""
    family = MOE_BLOCKS.get(type(block).__name__)
    if family is None:
        return f"{type(block).__name__} is not a sparse MoE block fusedllm knows"
    router_attr = router_name(family)
    router, experts = getattr(block, router_attr, None), getattr(block, "experts", None)
    if router is None or experts is None:
        return f"expected `{router_attr}` (the router) and `experts` submodules"
    settings = _route_settings(router, family)
    if isinstance(settings, str):
        return settings
    problem = experts_problem(experts)
    if problem is not None:
        return problem
    hidden_dim = experts.gate_up_proj.shape[1 if getattr(experts, "is_transposed", False) else 2]
    if experts.gate_up_proj.shape[0] != router.weight.shape[0] or hidden_dim != router.weight.shape[1]:
        return (f"router weight {list(router.weight.shape)} does not match the experts' gate_up_proj "
                f"{list(experts.gate_up_proj.shape)}")
    new = _twin(block, _FusedBlock)
    new._modules[router_attr] = _twin(router, _FusedRouter, _fusedllm_route=settings)
    new._modules["experts"] = _twin(experts, _FusedExperts)
    return new


def block_note(block: nn.Module) -> str:
    """What the fused twin of ``block`` runs, for the patch report."""
    parts = ["router: moe_route", "experts: moe_experts"]
    jitter = getattr(block, "jitter_noise", 0) or 0
    if jitter > 0:
        parts.append(f"router_jitter_noise={jitter} applied in training by the block's own forward")
    if hasattr(block, "shared_expert"):
        parts.append("shared expert and its sigmoid gate: the model's own modules")
    if hasattr(block, "shared_experts"):
        parts.append("shared experts: the model's own MLP")
    experts = getattr(block, "experts", None)
    if getattr(experts, "has_bias", False):
        parts.append("experts' biases in the products' epilogues")
    if getattr(experts, "is_transposed", False):
        parts.append("weights read transposed where they lie")
    settings = experts_settings(experts) if isinstance(experts, nn.Module) else None
    if isinstance(settings, dict) and settings.get("activation") == "gpt_oss":
        parts.append(f"gpt-oss's clamped SwiGLU (interleaved gate/up, limit={settings['limit']:g}, "
                     f"alpha={settings['alpha']:g})")
    return "; ".join(parts)


def register() -> None:
    """Register :func:`experts_forward` as ``experts_implementation="fusedllm"``.
    Idempotent; :mod:`fusedllm.hf` calls it. A transformers without the
    experts interface (before 5) has nothing to register with."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return
    ExpertsInterface.register(NAME, experts_forward)
