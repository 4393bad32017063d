"""Hugging Face sparse mixture-of-experts layers on :func:`fusedllm.moe_route`
and :func:`fusedllm.moe_experts`.

Two ways in:

- ``experts_implementation="fusedllm"``: :func:`experts_forward` is
  registered with transformers' ``ExpertsInterface``, so every experts class
  decorated with ``@use_experts_implementation`` (Mixtral, Qwen2/3-MoE,
  OLMoE, DeepSeek-V3, ...) can run its experts through the fused op::

      model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="fusedllm")
      model.set_experts_implementation("fusedllm")   # or switch an existing model

  Registration happens with ``attn_implementation="fusedllm"``'s (see
  :mod:`fusedllm.hf`), as soon as transformers' modeling code is imported
  after ``import fusedllm``. The router stays the model's own.

- ``fusedllm.patch(model)`` (``moe=True``) replaces the sparse MoE blocks of
  Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 by fused twins
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

import torch
import torch.nn.functional as F
from torch import nn

from . import functional as FF

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


def experts_problem(experts: nn.Module) -> str | None:
    """Why ``experts`` (a transformers experts module) cannot run on
    :func:`fusedllm.moe_experts`, or None."""
    if getattr(experts, "has_bias", False):
        return "its experts have biases (has_bias)"
    if getattr(experts, "is_transposed", False):
        return "its expert weights are stored transposed (is_transposed)"
    if not getattr(experts, "has_gate", True):
        return "its experts are not gated (has_gate=False: up_proj, no gate_up_proj)"
    if not getattr(experts, "is_concatenated", True):
        return "its gate_up_proj interleaves gate and up rows (is_concatenated=False), not [gate | up]"
    if getattr(experts, "has_post_expert_norm", False):
        return "it normalizes each expert's output (has_post_expert_norm)"
    if getattr(experts, "_is_expert_parallel", False):
        return "its experts are split across processes (expert parallelism)"
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is not None:
        from transformers.integrations.moe import _default_apply_gate

        if apply_gate is not _default_apply_gate:
            return f"{type(experts).__name__} has its own gating (_apply_gate)"
    act = getattr(experts, "act_fn", None)
    if experts_activation(act) is None:
        return (f"activation {type(act).__name__} has no fused kernel (silu, gelu_pytorch_tanh and gelu_new "
                f"have)")
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
            and gate_up.shape[0] == down.shape[0]):
        return ("expected gate_up_proj [experts, 2 * intermediate, hidden] and down_proj "
                "[experts, hidden, intermediate]")
    return None


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts contract on :func:`fusedllm.moe_experts`:
    ``hidden_states [tokens, hidden]``, ``top_k_index`` / ``top_k_weights``
    ``[tokens, top_k]`` -> ``[tokens, hidden]`` in ``hidden_states``' dtype.

    The routing weights are used in the dtype they come in where the op takes
    it (Mixtral's routers give float32, Qwen's and OLMoE's the model dtype);
    otherwise they are converted to the hidden dtype. Hidden states of
    another dtype than the expert weights (autocast) are converted to the
    weights' dtype, and the result back. Layouts the op has no kernel for
    (biases, transposed or interleaved weights, ungated experts, a custom
    gate, a post-expert norm, expert parallelism, other activations) are a
    ValueError naming the experts class."""
    problem = experts_problem(self)
    if problem is not None:
        raise ValueError(f"fusedllm: experts_implementation='{NAME}' cannot run {type(self).__name__}: {problem}; "
                         f"use experts_implementation='eager' (or 'grouped_mm') for this model")
    weight_dtype = self.gate_up_proj.dtype
    x = hidden_states if hidden_states.dtype == weight_dtype else hidden_states.to(weight_dtype)
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    weights = top_k_weights
    if weights.dtype not in (x.dtype, accumulate):
        weights = weights.to(x.dtype)
    out = FF.moe_experts(x, top_k_index, weights, self.gate_up_proj, self.down_proj,
                         experts_activation(self.act_fn))
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
        else:
            logits = F.linear(hidden, self.weight)
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
}
_ROUTERS = {"mixtral": "MixtralTopKRouter", "qwen": ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter"),
            "deepseek_v3": "DeepseekV3TopkRouter"}

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
                "scaling": 1.0, "float32_logits": False, "weights_in_logits_dtype": False}
    if family == "qwen":
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
    router, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if router is None or experts is None:
        return "expected `gate` (the router) and `experts` submodules"
    settings = _route_settings(router, family)
    if isinstance(settings, str):
        return settings
    problem = experts_problem(experts)
    if problem is not None:
        return problem
    if experts.gate_up_proj.shape[0] != router.weight.shape[0] or experts.gate_up_proj.shape[2] != router.weight.shape[1]:
        return (f"router weight {list(router.weight.shape)} does not match the experts' gate_up_proj "
                f"{list(experts.gate_up_proj.shape)}")
    new = _twin(block, _FusedBlock)
    new._modules["gate"] = _twin(router, _FusedRouter, _fusedllm_route=settings)
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
