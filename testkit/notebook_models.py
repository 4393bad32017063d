"""Plain-PyTorch models written the way the original notebooks build them: the same
class names, constructor arguments, parameter / buffer names and arithmetic,
re-implemented here as the oracle for fusedllm.compat and fusedllm.patch.

One namespace per notebook (``nb000`` ... ``nb003``), because the notebooks
reuse class names (three of them define an ``RMSNorm``) and fusedllm.patch
recognises notebook classes by their name. For the LLaMA notebook (003), whose
rotary code fails and whose attention rotates shared keys once per query head,
the classes compute the intended result (each head rotated once, pairs
``(2i, 2i + 1)``), as fusedllm.compat.nb003 documents.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F


def _build_nb000():
    class RMSNorm(nn.Module):
        def __init__(self, d_model, eps=1e-6):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(d_model))

        def forward(self, x):
            root_mean_square = (x.pow(2).mean(dim=-1, keepdim=True) + self.eps).sqrt()
            return self.weight * (x / root_mean_square)

    class SwiGLU(nn.Module):
        def __init__(self, input_dim, hidden_dim, bias=True):
            super().__init__()
            self.gate_proj = nn.Linear(input_dim, hidden_dim, bias=bias)
            self.up_proj = nn.Linear(input_dim, hidden_dim, bias=bias)
            self.down_proj = nn.Linear(hidden_dim, input_dim, bias=bias)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class ModernFeedForward(nn.Module):
        def __init__(self, d_model, d_ff, activation="swiglu", dropout=0.1):
            super().__init__()
            self.activation_type = activation
            if activation == "swiglu":
                self.ffn = SwiGLU(d_model, int(2 * d_ff / 3))
            else:
                act = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "mish": nn.Mish}[activation]
                self.ffn = nn.Sequential(nn.Linear(d_model, d_ff), act(), nn.Dropout(dropout),
                                         nn.Linear(d_ff, d_model), nn.Dropout(dropout))

        def forward(self, x):
            return self.ffn(x)

    class RotaryPositionalEmbedding(nn.Module):
        def __init__(self, d_model, max_len=8192, base=10000.0):
            super().__init__()
            self.d_model, self.max_len, self.base = d_model, max_len, base
            exponents = torch.arange(0, d_model, 2).float() / d_model
            angles = torch.arange(max_len).float()[:, None] * (1.0 / base ** exponents)[None, :]
            self.register_buffer("cos_cached", torch.cos(angles))
            self.register_buffer("sin_cached", torch.sin(angles))

        def forward(self, q, k, position_offset=0):
            rows = slice(position_offset, position_offset + q.shape[2])
            cos = self.cos_cached[rows].repeat(1, 2)
            sin = self.sin_cached[rows].repeat(1, 2)

            def turn(x):
                first, second = x.chunk(2, dim=-1)
                return x * cos + torch.cat([-second, first], dim=-1) * sin

            return turn(q), turn(k)

    class RoPEAttention(nn.Module):
        def __init__(self, d_model, n_heads, max_len=8192, dropout=0.1):
            super().__init__()
            self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
            self.w_q = nn.Linear(d_model, d_model, bias=False)
            self.w_k = nn.Linear(d_model, d_model, bias=False)
            self.w_v = nn.Linear(d_model, d_model, bias=False)
            self.w_o = nn.Linear(d_model, d_model, bias=False)
            self.rope = RotaryPositionalEmbedding(self.d_k, max_len)
            self.dropout = nn.Dropout(dropout)

        def forward(self, x, mask=None, position_offset=0):
            b, s, d = x.shape

            def split(t):
                return t.reshape(b, s, self.n_heads, self.d_k).permute(0, 2, 1, 3)

            q, k = self.rope(split(self.w_q(x)), split(self.w_k(x)), position_offset)
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_k)
            if mask is not None:
                scores = scores.masked_fill(mask == 0, -1e9)
            weights = self.dropout(scores.softmax(dim=-1))
            out = (weights @ split(self.w_v(x))).permute(0, 2, 1, 3).reshape(b, s, d)
            return self.w_o(out), weights

    def norms(d_model, norm_type):
        make = (lambda: RMSNorm(d_model)) if norm_type == "rmsnorm" else (lambda: nn.LayerNorm(d_model))
        return make(), make()

    class PreNormTransformerBlock(nn.Module):
        def __init__(self, d_model, n_heads, d_ff, dropout=0.1, norm_type="layernorm"):
            super().__init__()
            self.attention = RoPEAttention(d_model, n_heads, dropout=dropout)
            self.feed_forward = ModernFeedForward(d_model, d_ff, "swiglu", dropout)
            self.norm1, self.norm2 = norms(d_model, norm_type)
            self.dropout = nn.Dropout(dropout)

        def forward(self, x, mask=None):
            update, weights = self.attention(self.norm1(x), mask)
            x = x + self.dropout(update)
            return x + self.dropout(self.feed_forward(self.norm2(x))), weights

    class PostNormTransformerBlock(nn.Module):
        def __init__(self, d_model, n_heads, d_ff, dropout=0.1, norm_type="layernorm"):
            super().__init__()
            self.attention = RoPEAttention(d_model, n_heads, dropout=dropout)
            self.feed_forward = ModernFeedForward(d_model, d_ff, "swiglu", dropout)
            self.norm1, self.norm2 = norms(d_model, norm_type)
            self.dropout = nn.Dropout(dropout)

        def forward(self, x, mask=None):
            update, weights = self.attention(x, mask)
            x = self.norm1(x + self.dropout(update))
            return self.norm2(x + self.dropout(self.feed_forward(x))), weights

    class ModernTransformerBlock(nn.Module):
        def __init__(self, d_model, n_heads, d_ff, max_len=8192, dropout=0.1):
            super().__init__()
            self.attention = RoPEAttention(d_model, n_heads, max_len, dropout)
            self.feed_forward = ModernFeedForward(d_model, d_ff, "swiglu", dropout)
            self.norm1 = RMSNorm(d_model)
            self.norm2 = RMSNorm(d_model)
            self.dropout = nn.Dropout(dropout)

        def forward(self, x, mask=None, position_offset=0):
            update, weights = self.attention(self.norm1(x), mask, position_offset)
            x = x + self.dropout(update)
            return x + self.dropout(self.feed_forward(self.norm2(x))), weights

    class ModernTransformer(nn.Module):
        def __init__(self, vocab_size, d_model, n_layers, n_heads, d_ff, max_len=8192, dropout=0.1,
                     tie_weights=True):
            super().__init__()
            self.d_model, self.n_layers = d_model, n_layers
            self.token_embedding = nn.Embedding(vocab_size, d_model)
            self.layers = nn.ModuleList(
                ModernTransformerBlock(d_model, n_heads, d_ff, max_len, dropout) for _ in range(n_layers))
            self.final_norm = RMSNorm(d_model)
            self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
            if tie_weights:
                self.lm_head.weight = self.token_embedding.weight
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.xavier_uniform_(module.weight)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, nn.Embedding):
                    nn.init.normal_(module.weight, std=0.02)

        def forward(self, input_ids, attention_mask=None, position_offset=0):
            s = input_ids.shape[1]
            x = self.token_embedding(input_ids) * math.sqrt(self.d_model)
            if attention_mask is None:
                attention_mask = torch.ones(s, s, device=input_ids.device).tril()[None, None]
            for layer in self.layers:
                x, _ = layer(x, attention_mask, position_offset)
            return self.lm_head(self.final_norm(x))

    return SimpleNamespace(**{k: v for k, v in locals().items() if isinstance(v, type)})


def _build_nb001():
    def attend(q, k, v, mask, dropout):
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        return dropout(scores.softmax(dim=-1)) @ v

    class OriginalMultiHeadAttention(nn.Module):
        def __init__(self, d_model, num_heads, dropout=0.1):
            super().__init__()
            self.d_model, self.num_heads, self.d_k = d_model, num_heads, d_model // num_heads
            self.W_q = nn.Linear(d_model, d_model)
            self.W_k = nn.Linear(d_model, d_model)
            self.W_v = nn.Linear(d_model, d_model)
            self.W_o = nn.Linear(d_model, d_model)
            self.dropout = nn.Dropout(dropout)

        def forward(self, query, key, value, mask=None):
            def split(t):
                return t.reshape(t.shape[0], t.shape[1], self.num_heads, self.d_k).permute(0, 2, 1, 3)

            out = attend(split(self.W_q(query)), split(self.W_k(key)), split(self.W_v(value)), mask,
                         self.dropout)
            return self.W_o(out.permute(0, 2, 1, 3).reshape(query.shape[0], query.shape[1], self.d_model))

    class ModernMultiHeadAttention(nn.Module):
        def __init__(self, d_model, num_heads, dropout=0.1, bias=True):
            super().__init__()
            self.d_model, self.num_heads, self.d_k = d_model, num_heads, d_model // num_heads
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
            self.proj = nn.Linear(d_model, d_model, bias=bias)
            self.attn_dropout = nn.Dropout(dropout)
            self.proj_dropout = nn.Dropout(dropout)

        def forward(self, x, mask=None):
            b, s, d = x.shape
            parts = self.qkv(x).reshape(b, s, 3, self.num_heads, self.d_k)
            q, k, v = (parts[:, :, i].transpose(1, 2) for i in range(3))
            out = attend(q, k, v, mask, self.attn_dropout).transpose(1, 2).reshape(b, s, d)
            return self.proj_dropout(self.proj(out))

    class OriginalTransformerBlock(nn.Module):
        def __init__(self, d_model, num_heads, d_ff, dropout=0.1):
            super().__init__()
            self.attention = OriginalMultiHeadAttention(d_model, num_heads, dropout)
            self.ffn = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Dropout(dropout),
                                     nn.Linear(d_ff, d_model))
            self.norm1 = nn.LayerNorm(d_model)
            self.norm2 = nn.LayerNorm(d_model)
            self.dropout1 = nn.Dropout(dropout)
            self.dropout2 = nn.Dropout(dropout)

        def forward(self, x, mask=None):
            x = self.norm1(x + self.dropout1(self.attention(x, x, x, mask)))
            return self.norm2(x + self.dropout2(self.ffn(x)))

    class ModernTransformerBlock(nn.Module):
        def __init__(self, d_model, num_heads, d_ff, dropout=0.1, bias=True):
            super().__init__()
            self.attention = ModernMultiHeadAttention(d_model, num_heads, dropout, bias=bias)
            self.ffn = nn.Sequential(nn.Linear(d_model, d_ff, bias=bias), nn.GELU(), nn.Dropout(dropout),
                                     nn.Linear(d_ff, d_model, bias=bias), nn.Dropout(dropout))
            self.norm1 = nn.LayerNorm(d_model)
            self.norm2 = nn.LayerNorm(d_model)

        def forward(self, x, mask=None):
            x = x + self.attention(self.norm1(x), mask)
            return x + self.ffn(self.norm2(x))

    return SimpleNamespace(**{k: v for k, v in locals().items() if isinstance(v, type)})


def _build_nb002():
    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            x32 = x.float()
            normed = x32 / (x32.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
            return normed.type_as(x) * self.weight

    class SimpleAttention(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.dim = dim
            self.qkv = nn.Linear(dim, dim * 3, bias=False)
            self.out = nn.Linear(dim, dim, bias=False)
            self.scale = dim ** -0.5

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self.out(((q @ k.transpose(-1, -2)) * self.scale).softmax(-1) @ v)

    def ffn(dim):
        return nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))

    class PostNormBlock(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.attention = SimpleAttention(dim)
            self.ffn = ffn(dim)
            self.ln1 = RMSNorm(dim)
            self.ln2 = RMSNorm(dim)

        def forward(self, x):
            x = self.ln1(x + self.attention(x))
            return self.ln2(x + self.ffn(x))

    class PreNormBlock(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.attention = SimpleAttention(dim)
            self.ffn = ffn(dim)
            self.ln1 = RMSNorm(dim)
            self.ln2 = RMSNorm(dim)

        def forward(self, x):
            x = x + self.attention(self.ln1(x))
            return x + self.ffn(self.ln2(x))

    return SimpleNamespace(**{k: v for k, v in locals().items() if isinstance(v, type)})


def rotate_pairs(x, cos, sin):
    """Rotate features (2i, 2i + 1) of x [..., S, D] by angles whose cos / sin are
    cos[:, i] / sin[:, i] ([S, D / 2]), as complex multiplication."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    turned = pairs * torch.complex(cos, sin)
    return torch.view_as_real(turned).reshape(x.shape).to(x.dtype)


def _build_nb003():
    class LLaMAConfig:
        def __init__(self):
            self.vocab_size = 32000
            self.hidden_size = 768
            self.intermediate_size = 2048
            self.n_layers = 12
            self.n_heads = 32
            self.n_kv_heads = 8
            self.head_dim = 64
            self.max_position_embeddings = 2048
            self.rope_theta = 10000.0
            self.norm_eps = 1e-5
            self.dropout = 0.0

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-5):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class RotaryEmbedding(nn.Module):
        def __init__(self, dim, max_position=2048, base=10000.0):
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim))
            self.max_position, self.dim = max_position, dim

        def forward(self, x, seq_len=None):
            seq_len = x.shape[1] if seq_len is None else seq_len
            angles = torch.arange(seq_len, device=x.device).float()[:, None] * self.inv_freq[None, :]
            angles = torch.cat([angles, angles], dim=-1)
            return angles.cos(), angles.sin()

    class LLaMAGroupQueryAttention(nn.Module):
        # every head rotated once; one query head at a time against its kv head
        def __init__(self, config):
            super().__init__()
            self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
            self.head_dim, self.hidden_size = config.head_dim, config.hidden_size
            self.n_rep = self.n_heads // self.n_kv_heads
            self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
            self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
            self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
            self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
            self.rope = RotaryEmbedding(self.head_dim, max_position=config.max_position_embeddings,
                                        base=config.rope_theta)

        def forward(self, x, attention_mask=None):
            b, t, _ = x.shape
            q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
            cos, sin = self.rope(x, seq_len=t)
            half = self.head_dim // 2
            q, k = rotate_pairs(q, cos[:, :half], sin[:, :half]), rotate_pairs(k, cos[:, :half], sin[:, :half])
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            heads = []
            for h in range(self.n_heads):
                g = h // self.n_rep
                scores = q[:, h] @ k[:, g].transpose(-1, -2) / math.sqrt(self.head_dim)
                scores = scores.masked_fill(future, float("-inf"))
                if attention_mask is not None:
                    m = attention_mask.broadcast_to(b, self.n_heads, t, t)[:, h]
                    scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
                heads.append(scores.softmax(-1) @ v[:, g])
            out = torch.stack(heads, dim=1).transpose(1, 2).reshape(b, t, -1)
            return self.o_proj(out)

    class LLaMASwiGLU(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

        def forward(self, x):
            # the notebook's convention: w3 gates, w1 carries the signal
            return self.w2(self.w1(x) * F.silu(self.w3(x)))

    class LLaMABlock(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.hidden_size = config.hidden_size
            self.attention_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
            self.attention = LLaMAGroupQueryAttention(config)
            self.ffn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
            self.feed_forward = LLaMASwiGLU(config)

        def forward(self, x):
            h = x + self.attention(self.attention_norm(x))
            return h + self.feed_forward(self.ffn_norm(h))

    class LLaMAModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.vocab_size, self.hidden_size = config.vocab_size, config.hidden_size
            self.token_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(LLaMABlock(config) for _ in range(config.n_layers))
            self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)

        def forward(self, input_ids):
            h = self.token_embeddings(input_ids)
            for layer in self.layers:
                h = layer(h)
            return self.lm_head(self.norm(h))

    return SimpleNamespace(**{k: v for k, v in locals().items() if isinstance(v, type)})


nb000 = _build_nb000()
nb001 = _build_nb001()
nb002 = _build_nb002()
nb003 = _build_nb003()


def tiny_llama_config(cfg_cls, **overrides):
    """A few-thousand-parameter LLaMA configuration on either config class."""
    cfg = cfg_cls()
    sizes = dict(vocab_size=61, hidden_size=32, intermediate_size=48, n_layers=2, n_heads=4, n_kv_heads=2,
                 head_dim=8, max_position_embeddings=64)
    sizes.update(overrides)
    for name, value in sizes.items():
        setattr(cfg, name, value)
    return cfg


# --- the eager modules the op benchmarks time and the state-dict tests load from ---------

NotebookRMSNorm = nb002.RMSNorm  # float32 statistics, cast back, scale
NotebookSwiGLU = nb000.SwiGLU
NotebookRotaryEmbedding = nb000.RotaryPositionalEmbedding  # chunk / cat rotate_half
