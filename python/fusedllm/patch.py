"""Swap fused modules into a model that already exists.

``fusedllm.patch(model)`` walks the module tree and replaces, in place:

- the notebooks' classes, recognised by class name AND structure
  (attributes, submodules, parameter shapes), wherever they were defined
  (``__main__`` in a notebook, or a user's file holding the same code):
  ``RMSNorm``, ``SwiGLU``, ``LLaMASwiGLU``, ``RotaryPositionalEmbedding`` and
  the attention classes ``RoPEAttention``, ``OriginalMultiHeadAttention``,
  ``ModernMultiHeadAttention``, ``SimpleAttention``,
  ``LLaMAGroupQueryAttention``, by their :mod:`fusedllm.compat` drop-ins;
- Hugging Face Llama, Mistral, Qwen2/3 and Phi-3 RMSNorms (Llama casting),
  Gemma, Gemma 2 and Gemma 3 RMSNorms (``offset=1``, Gemma casting), OLMo 2
  and gpt-oss RMSNorms (weight multiplied in float32, Gemma casting without
  the offset; OLMo 2's q/k norms over all heads' projections included),
  their gated MLPs (SwiGLU, or GeGLU-tanh for Gemma; Phi-3's packed
  ``gate_up_proj``), and attention, by switching the model to the
  ``"fusedllm"`` attention implementation (:mod:`fusedllm.hf`): Llama,
  Mistral, Qwen2/3, Phi-3, Gemma, Gemma 2 (soft-capped logits) and Gemma 3
  text (global and sliding layers), OLMo 2, gpt-oss (attention sinks,
  sliding layers), Cohere, GPT-NeoX. A norm whose weight has another dtype
  than the model computes in (gpt-oss keeps some in float32 when loaded in
  float16) is left, and the report says why;
- Hugging Face parallel-residual decoder layers, ``x + attn(norm(x)) +
  mlp(norm(x))``: GPT-J's ``GPTJBlock``, GPT-NeoX / Pythia's ``GPTNeoXLayer``
  with ``use_parallel_residual``, Cohere's ``CohereDecoderLayer``, by fused
  twins (:mod:`fusedllm.compat.hf_parallel`): one input GEMM where attention
  and MLP share a norm, fused RoPE and attention (and SwiGLU for Cohere), one
  output GEMM over ``[attention | MLP hidden]`` with the residual. Their
  LayerNorms and ungated GELUs stay torch's, and the report lists them as
  left; Falcon's layers are left, and the report says why;
- Hugging Face sparse mixture-of-experts blocks (Mixtral, Qwen2-MoE,
  Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss's ``GptOssMLP``) by fused twins
  (:mod:`fusedllm.hf_moe`): the block's own forward (router jitter, shared
  experts) on a router that is :func:`fusedllm.moe_route` (gpt-oss's with
  its bias in the logits) and experts that are :func:`fusedllm.moe_experts`
  (gpt-oss's biases, transposed weights, interleaved gate/up and clamped
  SwiGLU included). Other MoE blocks, and experts the op cannot run, are
  left, and the report says why.

Every replacement holds the very same ``Parameter`` objects (and the same
``nn.Linear`` submodules) as the module it replaces, so an optimizer built
before patching keeps training them and ``state_dict()`` keys do not change.
``fusedllm.unpatch(model)`` puts the original modules back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from . import _devices, hf_loss, hf_moe
from . import nn as fnn
from .compat import hf_parallel, nb000, nb001, nb002, nb003
from .compat._common import eps_of, gated_linears, is_linear, norm_weight, shell

__all__ = ["patch", "unpatch", "PatchReport"]

_REGISTRY_ATTR = "_fusedllm_patches"
_ATTN_ATTR = "_fusedllm_previous_attn_implementation"


@dataclass
class Replaced:
    path: str
    original: str
    replacement: str
    verified: bool | None = None  # None: not checked
    note: str = ""


@dataclass
class Left:
    path: str
    module: str
    reason: str


@dataclass
class PatchReport:
    """What :func:`patch` did: ``replaced`` (path, original class, fused class,
    whether it was verified), ``left`` (candidates kept as they were, and why),
    ``attention`` (the Hugging Face attention implementation switch, or why
    it was not made), ``loss`` (with ``cross_entropy=True``: the fused
    causal-LM loss, or why the model was left) and ``device`` (set when the
    model's tensors lie on a device fusedllm has no kernels for: why, and
    that the replacements run the plain-PyTorch path there)."""

    replaced: list[Replaced] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    attention: str = ""
    loss: str = ""
    device: str = ""

    def count(self, replacement_contains: str = "") -> int:
        return sum(replacement_contains in r.replacement for r in self.replaced)

    def __str__(self) -> str:
        lines = [f"fusedllm.patch: {len(self.replaced)} module(s) replaced, {len(self.left)} left"]
        if self.device:
            lines.append(f"  device: {self.device}")
        for r in self.replaced:
            check = {True: " [verified]", False: "", None: ""}[r.verified]
            note = f" ({r.note})" if r.note else ""
            lines.append(f"  replaced {r.path or '<root>'}: {r.original} -> {r.replacement}{check}{note}")
        for item in self.left:
            lines.append(f"  left     {item.path or '<root>'}: {item.module}: {item.reason}")
        if self.attention:
            lines.append(f"  attention: {self.attention}")
        if self.loss:
            lines.append(f"  cross-entropy: {self.loss}")
        return "\n".join(lines)


# --- recognising modules --------------------------------------------------------------

# --- notebook classes: each compat module builds its drop-ins -------------------------

_NOTEBOOK_RULES = {**nb000.PATCH_RULES, **nb001.PATCH_RULES, **nb002.PATCH_RULES, **nb003.PATCH_RULES}


# --- Hugging Face modules -------------------------------------------------------------

_HF_LLAMA_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                   "Phi3RMSNorm"}
_HF_GEMMA_NORMS = {"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"}
# `weight * normalized` in float32, cast last: Gemma's casting without its offset
_HF_FLOAT32_WEIGHT_NORMS = {"Olmo2RMSNorm", "GptOssRMSNorm"}
_HF_GATED_MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP",
                  "CohereMLP", "Olmo2MLP"}
_HF_PACKED_MLPS = {"Phi3MLP"}
# model types whose attention goes through AttentionInterface with nothing the
# fused kernel lacks (Gemma 2's soft-capped logits and gpt-oss's sinks it has)
_HF_ATTENTION_MODELS = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "olmo2",
                        "gpt_oss", "cohere", "gpt_neox"}
# model types whose attention runs its own code, fused only inside their fused parallel layers
_HF_OWN_ATTENTION = {"gptj": "GPT-J computes attention itself (no AttentionInterface)",
                     "falcon": "Falcon computes attention itself (no AttentionInterface)"}


class _Reason(str):
    """Why a module is left, when the reason is not its structure."""


def _hf_norm(m, offset, casting, compute_dtype):
    w, eps = norm_weight(m), eps_of(m, "eps", "variance_epsilon")
    if w is None or eps is None:
        return "expected one 1-D `weight` parameter and a numeric eps"
    if compute_dtype is not None and w.dtype != compute_dtype:
        # the fused op takes the weight in the input's dtype; casting it would
        # change what the model computes (and the Parameter it trains)
        return _Reason(f"its weight is {w.dtype} but the model computes in {compute_dtype} (e.g. kept in "
                       f"float32 by _keep_in_fp32_modules); the fused RMSNorm takes the weight in the input's dtype")
    new = shell(fnn.RMSNorm, w.shape[0], eps=eps, offset=offset, casting=casting)
    new.weight = w
    return new


def _hf_gated_mlp(m):
    linears = gated_linears(m, "gate_proj", "up_proj", "down_proj")
    if linears is None:
        return "expected nn.Linear gate_proj / up_proj / down_proj of matching shapes"
    activation = hf_moe.experts_activation(getattr(m, "act_fn", None))
    if activation is None:
        return f"activation {type(getattr(m, 'act_fn', None)).__name__} has no fused kernel"
    g, u, d = linears
    new = shell(fnn.GatedMLP, g.in_features, g.out_features, bias=g.bias is not None, activation=activation)
    new.gate_proj, new.up_proj, new.down_proj = g, u, d
    return new


def _hf_packed_mlp(m):
    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (is_linear(gate_up) and is_linear(down) and gate_up.out_features == 2 * down.in_features
            and down.out_features == gate_up.in_features):
        return "expected nn.Linear gate_up_proj (h -> 2f) and down_proj (f -> h)"
    activation = hf_moe.experts_activation(getattr(m, "activation_fn", None))
    if activation is None:
        return f"activation {type(getattr(m, 'activation_fn', None)).__name__} has no fused kernel"
    new = shell(fnn.PackedGatedMLP, gate_up.in_features, down.in_features, activation=activation,
                 bias=gate_up.bias is not None)
    new.gate_up_proj, new.down_proj = gate_up, down
    return new


# class-name endings of transformers' sparse MoE blocks: those not in
# hf_moe.MOE_BLOCKS are reported as left
_HF_MOE_SUFFIXES = ("SparseMoeBlock", "SparseMoE", "MoeBlock", "MoE", "MoeLayer", "MoELayer")


def _experts_problems(experts) -> list[str]:
    """What in a transformers experts module moe_experts has no kernel for."""
    if not isinstance(experts, nn.Module):
        return []
    problem = hf_moe.experts_problem(experts)
    return [] if problem is None else [problem]


def _hf_moe_left(m):
    name = type(m).__name__
    problems = _experts_problems(getattr(m, "experts", None))
    if problems:
        return (f"{name} is not one of the sparse MoE blocks fusedllm fuses, and its experts cannot run on "
                f"moe_experts (nor experts_implementation='fusedllm'): " + "; ".join(problems))
    return (f"{name} is not one of the sparse MoE blocks fusedllm fuses "
            f"({', '.join(hf_moe.MOE_BLOCKS)}); experts_implementation='fusedllm' may still run its experts")


def _hf_rule(module, compute_dtype=None):
    name = type(module).__name__
    if name in hf_moe.MOE_BLOCKS:
        return "moe", hf_moe.fused_moe_block
    if name.endswith(_HF_MOE_SUFFIXES) and hasattr(module, "experts"):
        return "moe", _hf_moe_left
    if name in _HF_LLAMA_NORMS:
        return "rms_norm", lambda m: _hf_norm(m, 0.0, "llama", compute_dtype)
    if name in _HF_GEMMA_NORMS:
        return "rms_norm", lambda m: _hf_norm(m, 1.0, "gemma", compute_dtype)
    if name in _HF_FLOAT32_WEIGHT_NORMS:
        return "rms_norm", lambda m: _hf_norm(m, 0.0, "gemma", compute_dtype)
    if name in _HF_GATED_MLPS:
        return "swiglu", _hf_gated_mlp
    if name in _HF_PACKED_MLPS:
        return "swiglu", _hf_packed_mlp
    if name in hf_parallel.PARALLEL_LAYERS:
        return "parallel", hf_parallel.fused_parallel_layer
    return None


# --- verification ---------------------------------------------------------------------

def _probe_inputs(module, kind, new):
    param = next(module.parameters(), None)
    if param is None:
        param = next(module.buffers())
    dtype = param.dtype if param.is_floating_point() else torch.float32
    device = param.device
    if kind == "moe":
        router = getattr(module, hf_moe.router_name(hf_moe.MOE_BLOCKS[type(module).__name__]))
        return (torch.randn(2, 5, router.weight.shape[1], dtype=dtype, device=device),), {}
    if kind == "rope":
        d = 2 * module.cos_cached.shape[1]
        q = torch.randn(2, 2, 5, d, dtype=dtype, device=device)
        return (q, torch.randn_like(q)), {}
    first = next(lin for lin in new.modules() if isinstance(lin, nn.Linear)) if not isinstance(new, fnn.RMSNorm) \
        else None
    dim = new.weight.shape[0] if first is None else first.in_features
    x = torch.randn(2, 5, dim, dtype=dtype, device=device)
    if kind == "qkv":
        return (x, x, x), {}
    return (x,), {}


def _tolerance(dtype):
    if dtype == torch.float64:
        return 1e-9
    if dtype == torch.float32:
        return 1e-4
    return 3e-2


def _verify(original, new, kind):
    """None when ``new`` computes what ``original`` does on a random input;
    otherwise a sentence saying how they differ. Both run in eval mode (no
    dropout) without gradients; training flags are restored."""
    args, kwargs = _probe_inputs(original, kind, new)
    modes = [(m, m.training) for m in (*original.modules(), *new.modules())]
    try:
        original.eval()
        new.eval()
        with torch.no_grad():
            expected = original(*args, **kwargs)
            try:
                actual = new(*args, **kwargs)
            except Exception as exc:  # the replacement cannot take this module's input
                return f"the fused module failed on the probe input ({type(exc).__name__}: {exc})"
    finally:
        for m, training in modes:
            m.training = training
    expected = expected if isinstance(expected, tuple) else (expected,)
    actual = actual if isinstance(actual, tuple) else (actual,)
    for e, a in zip(expected, actual):
        if e is None or a is None:
            continue
        if e.shape != a.shape:
            return f"output shapes differ: {tuple(e.shape)} vs {tuple(a.shape)}"
        tol = _tolerance(e.dtype)
        scale = max(1.0, e.abs().max().item())
        diff = (a.float() - e.float()).abs().max().item()
        if not diff <= tol * scale:
            return f"outputs differ by up to {diff:.3g} (allowed {tol * scale:.3g})"
    return None


# --- the walk ---------------------------------------------------------------------------

def _is_ours(module) -> bool:
    return type(module).__module__.startswith("fusedllm")


def _is_transformers(module) -> bool:
    return type(module).__module__.startswith("transformers")


def _public_name(cls) -> str:
    """Where a user finds cls: fusedllm.nn.X for the modules that package
    exports (each defined in one of its submodules), else its own module."""
    if getattr(fnn, cls.__name__, None) is cls:
        return f"fusedllm.nn.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _compute_dtype(model):
    """The dtype a Hugging Face model computes in (its input embeddings'), or None."""
    get = getattr(model, "get_input_embeddings", None)
    if not _is_transformers(model) or not callable(get):
        return None
    try:
        weight = getattr(get(), "weight", None)
    except (NotImplementedError, AttributeError):
        return None
    return weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else None


def _device_note(model) -> str:
    """For the report: the model's device types without fusedllm kernels, and what runs there."""
    without = _devices.without_kernels(t.device.type for t in itertools.chain(model.parameters(),
                                                                             model.buffers()))
    return "; ".join(
        f"model on {t}: {_devices.no_kernels_reason(t)}; the replaced modules run fusedllm's plain-PyTorch "
        f"path there (same results, not fused, possibly slower than the originals; fusedllm.unpatch(model) "
        f"puts them back)" for t in without)


def _switch_hf_attention(model, report):
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation") or not _is_transformers(model):
        return
    model_type = getattr(config, "model_type", None)
    if model_type in _HF_OWN_ATTENTION:
        fused = sum(r.replacement.startswith(hf_parallel.__name__) for r in report.replaced)
        where = f"; fusedllm attention runs inside the {fused} fused layer(s)" if fused else ""
        report.attention = (f"left as {config._attn_implementation!r}: {_HF_OWN_ATTENTION[model_type]}"
                            f"{where}")
        return
    if model_type not in _HF_ATTENTION_MODELS:
        report.attention = f"left as {config._attn_implementation!r}: model type {model_type!r} is not supported"
        return
    try:
        from . import hf
    except ImportError as exc:
        report.attention = f"left as {config._attn_implementation!r}: {exc}"
        return
    previous = config._attn_implementation
    if previous == hf.NAME:
        report.attention = f"already {hf.NAME!r}"
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(hf.NAME)
    else:
        config._attn_implementation = hf.NAME
    if not hasattr(model, _ATTN_ATTR):
        object.__setattr__(model, _ATTN_ATTR, previous)
    report.attention = f"{previous!r} -> {hf.NAME!r}"


# Families whose fused version is not yet the faster one on a GPU, with the
# measurement that says so: patch() leaves them there unless asked (None = auto).
_SLOWER_ON_GPU = {
    "attention": "fusedllm's CUDA attention ran at 0.10-0.16x SDPA's speed (H100, bf16, forward and backward)",
    "parallel": "the fused parallel layers run fusedllm's CUDA attention (0.10-0.16x SDPA's speed on an H100)",
    "moe": "fusedllm's CUDA experts ran at 0.38-0.99x grouped_mm's speed, and 0.49-0.63x the eager "
           "experts' in float32 (H100)",
}


def _auto_families(model) -> dict:
    """What ``None`` means for the families above: fused where the model lies on
    the CPU only (or has no tensors), else left as they are, with the reason."""
    types = {t.device.type for t in itertools.chain(model.parameters(), model.buffers())}
    if types <= {"cpu"}:
        return {name: (True, "") for name in _SLOWER_ON_GPU}
    where = "/".join(sorted(types - {"cpu"}))
    return {name: (False, f"left on {where} by default: {why}; {name}=True chooses fusedllm's")
            for name, why in _SLOWER_ON_GPU.items()}


def patch(model: nn.Module, *, rms_norm: bool = True, swiglu: bool = True, rope: bool = True,
          attention: bool | None = None, parallel: bool | None = None, moe: bool | None = None,
          cross_entropy: bool = False, verify: bool = False) -> PatchReport:
    """Replace, in place, the modules of ``model`` that fusedllm has fused
    versions of; return a :class:`PatchReport` (``print(report)`` for a summary).

    ``rms_norm``, ``swiglu``, ``rope``, ``attention`` choose the families
    (Hugging Face attention is switched to ``attn_implementation="fusedllm"``
    rather than replaced); ``parallel`` the Hugging Face parallel-residual
    decoder layers (GPT-J, GPT-NeoX with ``use_parallel_residual``, Cohere),
    replaced whole; ``moe`` the Hugging Face sparse MoE blocks (Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss), whose routers and experts are
    replaced by fused twins. Replacements keep the original ``Parameter``
    objects, submodules and training mode; an optimizer built before patching
    keeps working, and so do ``state_dict`` / ``load_state_dict``.

    ``attention``, ``parallel`` and ``moe`` default to ``None``: fused when the
    model lies on the CPU, left as they are on a GPU (or any other device),
    where fusedllm's versions are not yet faster than the model's own (SDPA,
    grouped or eager experts); the report says so for each module left.
    ``True`` fuses them anywhere, ``False`` nowhere. The choice follows where
    the model is when it is patched.

    ``verify=True`` runs each original and its replacement on a random input
    (eval mode, no gradients) and keeps the original where the outputs differ
    beyond float rounding; the report says so. A notebook module that itself
    fails on that input (the LLaMA notebook's attention does) is replaced and
    marked as not compared. A fused parallel decoder layer is not compared on
    a probe (it needs the model's masks and positions); the report says so.

    ``cross_entropy=True`` gives a Hugging Face causal LM (Llama, Mistral,
    Qwen2/3, Gemma/Gemma 2/3, Phi-3) a forward whose training loss is
    :func:`fusedllm.linear_cross_entropy`: in training mode with ``labels`` no
    logits are built (``logits`` is None unless ``logits_to_keep`` asks for
    some); evaluation and generation run the model's own forward
    (:mod:`fusedllm.hf_loss`).

    The model itself (the root) is never replaced, only modules inside it.

    On a device fusedllm has no kernels for (MPS, XPU, a ROCm GPU; CUDA when
    fusedllm was built without its CUDA kernels) the same modules are
    replaced, so the model is the same wherever it is moved; there they run
    fusedllm's plain-PyTorch path, and ``report.device`` says so.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fusedllm.patch: model must be an nn.Module, got {type(model).__name__}")
    flags = {"rms_norm": rms_norm, "swiglu": swiglu, "rope": rope, "attention": attention, "parallel": parallel,
             "moe": moe}
    reasons = {name: f"{name}=False" for name in flags}
    for name, (default, why) in _auto_families(model).items():
        if flags[name] is None:
            flags[name] = default
            reasons[name] = why or reasons[name]
    patcher = _Patcher(model, flags, reasons, verify)
    report = patcher.report
    if patcher.consider("", model) is not None:
        report.replaced.pop()
        report.left.append(Left("", type(model).__name__,
                                "the model itself is not replaced in place; use fusedllm.compat or patch a parent"))
    patcher.walk(model, "")
    if flags["attention"]:
        _switch_hf_attention(model, report)
    elif attention is None and _is_transformers(model) and hasattr(getattr(model, "config", None),
                                                                   "_attn_implementation"):
        report.attention = f"left as {model.config._attn_implementation!r}: {reasons['attention']}"
    if cross_entropy:
        reason = hf_loss.patch_causal_lm(model)
        report.loss = ("fused: linear_cross_entropy, no logits in training" if reason is None
                       else f"left: {reason}")
    return report


class _Patcher:
    """One patch() call's walk: the families chosen (``flags``, and why each left
    one is: ``reasons``), the report it fills and the model's undo registry."""

    def __init__(self, model: nn.Module, flags: dict, reasons: dict, verify: bool):
        self.flags, self.reasons, self.verify = flags, reasons, verify
        self.report = PatchReport(device=_device_note(model))
        self.registry = model.__dict__.setdefault(_REGISTRY_ATTR, [])
        self.compute_dtype = _compute_dtype(model)

    def rule(self, module):
        """(family, build, probe kind) for ``module``, or None where nothing replaces it."""
        if _is_ours(module):
            return None
        if _is_transformers(module):
            rule = _hf_rule(module, self.compute_dtype)
            if rule is None:
                return None
            flag, build = rule
            return flag, build, "moe" if flag == "moe" else "hidden"
        return _NOTEBOOK_RULES.get(type(module).__name__)

    def consider(self, path, module):
        """A replacement for ``module``, or None (after noting why, if it was a candidate)."""
        rule = self.rule(module)
        if rule is None:
            return None
        flag, build, kind = rule
        name = type(module).__name__
        if not self.flags[flag]:
            self.report.left.append(Left(path, name, self.reasons[flag]))
            return None
        new = build(module)
        if isinstance(new, str):
            reason = (new if flag in ("parallel", "moe") or isinstance(new, _Reason)
                      else f"same name, different structure: {new}")
            self.report.left.append(Left(path, name, reason))
            return None
        new.train(module.training)
        entry = Replaced(path, name, _public_name(type(new)))
        if flag == "moe":
            entry.note = hf_moe.block_note(module)
        if flag == "parallel":
            entry.note = new.FUSED
            if self.verify:
                entry.note += "; not compared on a probe (a decoder layer needs the model's mask and positions)"
            for attr, cls_name, why in hf_parallel.kept_modules(module):
                self.report.left.append(Left(f"{path}.{attr}", cls_name, why))
        elif self.verify and not self.compared(path, module, new, kind, entry):
            return None
        self.report.replaced.append(entry)
        return new

    def compared(self, path, module, new, kind, entry) -> bool:
        """verify=True: whether ``new`` may replace ``module`` (their outputs agree,
        or a notebook original failed on the probe); notes the outcome."""
        name = type(module).__name__
        try:
            problem = _verify(module, new, kind)
        except Exception as exc:
            if _is_transformers(module):
                self.report.left.append(Left(path, name, f"verify: the original failed ({exc})"))
                return False
            entry.note = f"not compared: the original failed on the probe input ({type(exc).__name__})"
            return True
        entry.verified = problem is None
        if problem is not None:
            self.report.left.append(Left(path, name, f"verify: {problem}"))
            return False
        return True

    def walk(self, parent, prefix):
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{prefix}.{child_name}" if prefix else child_name
            new = self.consider(path, child)
            if new is None:
                self.walk(child, path)
                continue
            setattr(parent, child_name, new)
            self.registry.append((parent, child_name, child, new))


def unpatch(model: nn.Module) -> int:
    """Put back every module :func:`patch` replaced in ``model`` (latest first)
    and the previous Hugging Face attention implementation. The originals hold
    the same parameters, so training done while patched is kept; buffers the
    replacements moved (e.g. with ``.to(device)``) are handed back too.
    Returns the number of modules restored."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fusedllm.unpatch: model must be an nn.Module, got {type(model).__name__}")
    registry = model.__dict__.pop(_REGISTRY_ATTR, [])
    for parent, name, original, new in reversed(registry):
        new_buffers = dict(new.named_buffers())
        for buffer_name, _ in list(original.named_buffers()):
            if buffer_name in new_buffers:
                owner_path, _, leaf = buffer_name.rpartition(".")
                owner = original.get_submodule(owner_path) if owner_path else original
                setattr(owner, leaf, new_buffers[buffer_name])
        original.train(new.training)
        setattr(parent, name, original)
    hf_loss.unpatch_causal_lm(model)
    if _ATTN_ATTR in model.__dict__:
        previous = model.__dict__.pop(_ATTN_ATTR)
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(previous)
        else:
            model.config._attn_implementation = previous
    return len(registry)
