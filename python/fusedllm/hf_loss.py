"""Hugging Face causal LMs computing their training loss with
:func:`fusedllm.linear_cross_entropy`: the logits are never built.

``fusedllm.patch(model, cross_entropy=True)`` calls :func:`patch_causal_lm`.
The patched model's ``forward``, in training mode with ``labels``, runs the
decoder, then the LM head and transformers' causal-LM loss (labels shifted
by one, ``ignore_index``, ``shift_labels``, ``num_items_in_batch``, Gemma 2/3's
``final_logit_softcapping``) as one fused op, and returns ``logits=None``
unless ``logits_to_keep`` asks for some positions (then only those are
built). Without labels, or in eval mode, it is the model's own forward
(logits as usual, for generation and evaluation).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types

import torch
import torch.nn.functional as F

from ._sharding import is_dtensor
from .functional import linear_cross_entropy

# Model types whose causal-LM forward is decoder -> lm_head -> [final softcap]
# -> ForCausalLMLoss, which the fused forward reproduces.
CAUSAL_LM_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
_ATTR = "_fusedllm_fused_loss"


def supported(model: torch.nn.Module) -> str | None:
    """None when ``model`` can be patched, else why not."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in CAUSAL_LM_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(CAUSAL_LM_TYPES)}"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear) or not hasattr(model, "model"):
        return "not a causal LM with a decoder `model` and a linear `lm_head`"
    loss = getattr(model, "loss_function", None)
    if getattr(loss, "__name__", None) != "ForCausalLMLoss":
        return f"its loss function is {getattr(loss, '__name__', loss)!r}, not transformers' ForCausalLMLoss"
    return None


def causal_lm_loss(model, hidden: torch.Tensor, labels: torch.Tensor | None, *, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, num_items_in_batch=None) -> torch.Tensor:
    """transformers' ForCausalLMLoss on ``lm_head(hidden)`` (soft-capped as the
    config says), computed without the logits. float32, as transformers'."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = model.lm_head
    hidden, target = hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1).to(hidden.device)
    mesh = _mesh_of(head.weight)
    if mesh is not None:
        hidden, target = (_replicated(t, mesh) for t in (hidden, target))
    loss = linear_cross_entropy(
        hidden, head.weight, target, bias=head.bias, ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum",
        softcap=getattr(model.config, "final_logit_softcapping", None))
    if mesh is not None:
        loss = loss.full_tensor()  # the same on every rank, as the unfused head's loss
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _mesh_of(weight):
    """The device mesh of a DTensor LM head (tensor parallelism), else None."""
    return weight.device_mesh if is_dtensor(weight) else None


def _replicated(t, mesh):
    """``t`` as a DTensor over ``mesh``: as it is if it already is one, else
    taken as the same on every rank, as a tensor-parallel LM head takes its
    input (ColwiseParallel's default input layout). DTensor then gathers the
    vocabulary-sharded weight for the loss (docs/distributed.md)."""
    from torch.distributed.tensor import DTensor, Replicate
    if isinstance(t, DTensor):
        return t
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _fused_forward(self, input_ids=None, attention_mask=None, position_ids=None, *args, **kwargs):
    # Arguments past position_ids go on under the names the model's own forward
    # gives them (its cache is `past_key_values` before transformers 5.24 and
    # `cache` from it on), and only those the caller gave: naming a cache the
    # caller did not pass makes 5.24 warn at every call.
    if args:
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = [p.name for p in inspect.signature(type(self).forward).parameters.values()
                 if p.kind in positional][4:]
        owner = f"{type(self).__name__}.forward"
        if len(args) > len(names):
            raise TypeError(f"{owner} takes at most {3 + len(names)} positional arguments "
                            f"{['input_ids', 'attention_mask', 'position_ids'] + names}, got {3 + len(args)}")
        twice = [name for name in names[:len(args)] if name in kwargs]
        if twice:
            raise TypeError(f"{owner} got multiple values for argument {twice[0]!r}")
        kwargs.update(zip(names, args))
    labels = kwargs.pop("labels", None)
    if labels is None or not self.training:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # transformers before 5: the int and 1-D forms, as its models slice
        def slice_logits_to_keep(hidden, keep):
            return hidden[:, slice(-keep, None) if isinstance(keep, int) else keep, :]

    loss_kwargs = {k: kwargs.pop(k) for k in ("ignore_index", "shift_labels", "num_items_in_batch")
                   if k in kwargs}
    if "num_items_in_batch" in loss_kwargs:  # the decoder is given it too, as transformers does
        kwargs["num_items_in_batch"] = loss_kwargs["num_items_in_batch"]
    logits_to_keep = kwargs.pop("logits_to_keep", 0)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    hidden = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    loss = causal_lm_loss(self, hidden, labels, **loss_kwargs)
    logits = None
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
    cache = _CACHE_FIELD or _output_cache_field()
    return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions, **{cache: getattr(outputs, cache)})


# Read when a model is patched, not in its forward: torch.compile cannot trace dataclasses.fields.
_CACHE_FIELD: str | None = None


@functools.cache
def _output_cache_field() -> str:
    # `cache` from transformers 5.24 on (`past_key_values`, its old name, logs a warning)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


def patch_causal_lm(model: torch.nn.Module) -> str | None:
    """Gives ``model`` the fused-loss forward; returns None, or why it was not
    patched (the model is then unchanged)."""
    global _CACHE_FIELD
    reason = supported(model)
    if reason is None and not getattr(model, _ATTR, False):
        _CACHE_FIELD = _output_cache_field()
        model.forward = types.MethodType(_fused_forward, model)
        setattr(model, _ATTR, True)
    return reason


def unpatch_causal_lm(model: torch.nn.Module) -> bool:
    """Restores the model's own forward; whether it had the fused one."""
    if not getattr(model, _ATTR, False):
        return False
    del model.forward
    delattr(model, _ATTR)
    return True
