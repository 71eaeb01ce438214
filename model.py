"""
One GPT for both papers: GPT-2 (nanoGPT), the GPT-style models of paper B and the Llama-2-style
models of papers A and B, chosen by GPTConfig fields.

- positions: learned absolute embeddings ("learned") or rotary embeddings ("rope")
- MLP: GELU (up -> gelu -> down) or SwiGLU (down(silu(gate) * up))
- norm: LayerNorm or RMSNorm, pre-norm blocks plus a final norm before the LM head
- embeddings tied (GPT-2) or untied (papers' GPT-style and Llama-style)
- grouped-query attention with n_kv_head key/value heads, F.scaled_dot_product_attention

The linear layers of a block are named after the papers' "parts" so gaussws.apply_pqt finds
them by name: block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down for GPT-style models
(fused q/k/v projection), block.attn.q/k/v/out, block.mlp.gate/up/down for Llama-style ones.
The LM head is model.lm_head and is never replaced by PQT (paper A applies PQT to the block
linears only).

Activation checkpointing: `model.checkpoint_blocks = True` keeps only each block's input in training
and recomputes the block in backward (torch.utils.checkpoint, non-reentrant). A GaussWSLinear's
recomputation reuses the seed of its forward, so the gradients equal those of the run without it.
"""

import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


@dataclass
class GPTConfig:
    block_size: int = 1024        # context length (tokens)
    vocab_size: int = 50304       # GPT-2's 50257 padded up to a multiple of 64 (faster matmuls)
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 0            # key/value heads for GQA; 0 means n_head (plain multi-head)
    n_embd: int = 768
    ffn_hidden: int = 0           # MLP hidden width; 0 means 4 * n_embd
    pos: str = "learned"          # "learned" | "rope"
    mlp: str = "gelu"             # "gelu" | "swiglu"
    norm: str = "layernorm"       # "layernorm" | "rmsnorm"
    tie_embeddings: bool = True
    split_qkv: bool = False       # separate q, k, v linears (Llama parts) instead of one qkv
    bias: bool = False            # bias in Linear and LayerNorm (nanoGPT's train.py default)
    rope_theta: float = 10000.0
    dropout: float = 0.0

    def __post_init__(self):
        choices = {"pos": ("learned", "rope"), "mlp": ("gelu", "swiglu"), "norm": ("layernorm", "rmsnorm")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r}; allowed: {', '.join(allowed)}")
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.ffn_hidden == 0:
            self.ffn_hidden = 4 * self.n_embd
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"GPTConfig: n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if self.pos == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"GPTConfig: RoPE needs an even head size, got {self.n_embd // self.n_head}")

    @property
    def parts(self):
        """Names of the PQT-replaceable linear layers of one block (paper A's "method[part]" names)."""
        attn = ["q", "k", "v", "out"] if self.split_qkv else ["qkv", "out"]
        mlp = ["gate", "up", "down"] if self.mlp == "swiglu" else ["up", "down"]
        return attn + mlp


# Presets. GPT-style: GPT-2 tokenizer, 50304 vocab. Llama-style sizes are the papers' shapes; the
# papers count them with Llama-2's 32000-token vocabulary, we train them with the GPT-2 tokenizer,
# so the printed parameter count is larger by (50304 - 32000) * n_embd * (1 or 2).
_GPT2 = dict(pos="learned", mlp="gelu", norm="layernorm", tie_embeddings=True)
_GPTB = dict(pos="rope", mlp="gelu", norm="layernorm", tie_embeddings=False)          # paper B GPT-style
_LLAMA = dict(pos="rope", mlp="swiglu", norm="rmsnorm", tie_embeddings=False, split_qkv=True)
PRESETS = {
    # CPU-sized models: nano* for tests and smoke runs (seconds), tiny/small for CPU training
    "nano": dict(_GPT2, n_layer=2, n_head=2, n_embd=32, block_size=64),
    "nano-llama": dict(_LLAMA, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=96, block_size=64),
    "tiny": dict(_GPT2, n_layer=4, n_head=4, n_embd=128, block_size=128),
    "tiny-llama": dict(_LLAMA, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, ffn_hidden=352, block_size=128),
    "small": dict(_GPT2, n_layer=6, n_head=6, n_embd=384, block_size=256),
    # GPU quality runs at 20 tokens/param (python -m experiments quality): 2.76M params with the byte tokenizer
    "mini": dict(_GPT2, n_layer=6, n_head=6, n_embd=192, block_size=256),
    # nanoGPT's GPT-2 124M (paper A's GPT2-124M): learned positions, tied, GELU, LayerNorm
    "gpt2-124m": dict(_GPT2, n_layer=12, n_head=12, n_embd=768, block_size=1024),
    # paper B GPT-style (RoPE, GELU, untied, context 2048); 405M/834M use GPT-2 medium/large trunks
    "gpt-162m": dict(_GPTB, n_layer=12, n_head=12, n_embd=768, block_size=2048),
    "gpt-405m": dict(_GPTB, n_layer=24, n_head=16, n_embd=1024, block_size=2048),
    "gpt-834m": dict(_GPTB, n_layer=36, n_head=20, n_embd=1280, block_size=2048),
    # paper A Llama2-134M: 768/12/12, SwiGLU 2048, 134M with a 32000 vocab (needs full MHA for 134M)
    "llama-134m": dict(_LLAMA, n_layer=12, n_head=12, n_kv_head=12, n_embd=768, ffn_hidden=2048, block_size=2048),
    # paper B Llama-style 130M: same trunk with n_kv_head 4, context 1024
    "llama-130m": dict(_LLAMA, n_layer=12, n_head=12, n_kv_head=4, n_embd=768, ffn_hidden=2048, block_size=1024),
    # ~1.1B Llama (TinyLlama shape: 2048/22/32, 4 kv heads, SwiGLU 5632)
    "llama-1b": dict(_LLAMA, n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, ffn_hidden=5632, block_size=2048),
    # overhead benchmark shapes (paper A Table 1): ~3B (OpenLLaMA-3B shape) and Llama-2-70B cut to 4 layers
    "llama-3b": dict(_LLAMA, n_layer=26, n_head=32, n_kv_head=32, n_embd=3200, ffn_hidden=8640, block_size=2048),
    "llama-70b-4l": dict(_LLAMA, n_layer=4, n_head=64, n_kv_head=8, n_embd=8192, ffn_hidden=28672, block_size=2048),
}


def preset_config(name, **overrides):
    """GPTConfig for a preset name (see PRESETS) with keyword overrides (e.g. vocab_size, block_size).
    Raises ValueError naming the allowed presets for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r}; allowed: {', '.join(PRESETS)}")
    kw = dict(PRESETS[name])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return GPTConfig(**kw)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (no bias, no mean subtraction)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(config):
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


def rope_tables(head_dim, max_len, theta, device=None):
    """cos, sin tables of shape (max_len, head_dim // 2), float32 (rotary embeddings), made on
    `device` (default: the default device)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of x (B, nh, T, hs) by position angles."""
    T = x.shape[-2]
    cos, sin = cos[:T].to(x.dtype), sin[:T].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        kv_dim = self.n_kv_head * self.head_dim
        self.split_qkv = config.split_qkv
        if config.split_qkv:
            self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
            self.k = nn.Linear(config.n_embd, kv_dim, bias=config.bias)
            self.v = nn.Linear(config.n_embd, kv_dim, bias=config.bias)
        else:
            self.qkv = nn.Linear(config.n_embd, config.n_embd + 2 * kv_dim, bias=config.bias)
        self.out = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x, rope=None):
        B, T, C = x.shape
        if self.split_qkv:
            q, k, v = self.q(x), self.k(x), self.v(x)
        else:
            q, k, v = self.qkv(x).split([C, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.n_kv_head != self.n_head:
            # repeat kv heads explicitly: works with every SDPA backend (enable_gqa does not)
            rep = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(config.n_embd, config.ffn_hidden, bias=config.bias)
        self.up = nn.Linear(config.n_embd, config.ffn_hidden, bias=config.bias)
        self.down = nn.Linear(config.ffn_hidden, config.n_embd, bias=config.bias)

    def forward(self, x):
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = make_norm(config)
        self.attn = Attention(config)
        self.norm2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rope=None):
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only transformer.

    forward(idx, targets=None): idx int64 (B, T) token ids with T <= block_size.
    Returns (logits, loss): logits (B, T, vocab_size) in the compute dtype; loss is the mean
    cross-entropy (float32 scalar, nats/token) when targets (B, T) are given, else None, and then
    logits are computed for the last position only (B, 1, vocab_size).

    Built on the meta device (no memory, no init time) and then loaded:

        with torch.device("meta"):
            model = GPT(config)
            gaussws.apply_pqt(model, ...)     # as the state dict's model had, if it had PQT
        model.to_empty(device=device)
        model.load_state_dict(sd)

    gives, bit for bit, the model that GPT(config).to(device) loaded with sd is. The state dict
    holds the parameters and the persistent buffers (GaussWSLinear's noise_state); what it does
    not hold is a function of the config, and GPT.to_empty (nn.Module.to_empty: storage on
    `device`, values uninitialised) restores it: the tied LM head is tied to the embedding again
    (to_empty gives each module a new Parameter) and the RoPE tables, non-persistent buffers, are
    recomputed (`init_buffers`). After any other materialisation call `init_buffers()`. With no
    state dict to load, `reset_parameters()` initialises every parameter and buffer as __init__
    does (the same values as GPT(config) after the same torch.manual_seed, when there are no PQT
    layers).
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.norm_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # one Parameter: the LM head is the embedding
        if config.pos == "rope":
            cos, sin = rope_tables(config.n_embd // config.n_head, config.block_size, config.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self._init_gpt_weights()
        self.checkpoint_blocks = False   # activation checkpointing per block (module docstring)

    def _init_gpt_weights(self):
        self.apply(self._init_weights)
        # nanoGPT / GPT-2 init: residual output projections scaled by 1/sqrt(2 * n_layer)
        for block in self.blocks:
            for lin in (block.attn.out, block.mlp.down):
                nn.init.normal_(lin.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    @torch.no_grad()
    def init_buffers(self):
        """Recompute the non-persistent buffers (the RoPE tables) in place, keeping their device
        and dtype: computed in float32 on CPU, as GPT(config) on CPU does, and copied."""
        if self.config.pos == "rope":
            c = self.config
            cos, sin = rope_tables(c.n_embd // c.n_head, c.block_size, c.rope_theta, device="cpu")
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def to_empty(self, *, device, recurse=True):
        """nn.Module.to_empty, then the tie of the LM head to the embedding and the RoPE tables
        restored (they are not in the state dict; see the class docstring)."""
        super().to_empty(device=device, recurse=recurse)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.init_buffers()
        return self

    @torch.no_grad()
    def reset_parameters(self):
        """Initialise every parameter and buffer as __init__ does: each submodule's own init in
        construction order (so the same torch seed draws the same numbers; GaussWSLinear layers
        get b_i = 1 and noise_state = [key, 0]), the GPT-2 init on top, the RoPE tables."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        self._init_gpt_weights()
        self.init_buffers()

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, trainable_only=False):
        """Number of distinct parameters (a tied embedding/LM head counts once). PQT bitwidth
        parameters b_i are excluded: they are not weights of the network."""
        return sum(p.numel() for n, p in self.named_parameters()
                   if not n.endswith("b_i") and (p.requires_grad or not trainable_only))

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} > block_size {self.config.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)
        rope = (self.rope_cos, self.rope_sin) if self.config.pos == "rope" else None
        for block in self.blocks:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        x = self.norm_f(x)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens tokens after idx (B, T) int64; returns (B, T + max_new_tokens)."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx


def describe(config):
    """One-line architecture summary for logs."""
    c = asdict(config)
    return (f"{c['n_layer']}L d{c['n_embd']} h{c['n_head']}/kv{c['n_kv_head']} ffn{c['ffn_hidden']} "
            f"{c['pos']} {c['mlp']} {c['norm']} {'tied' if c['tie_embeddings'] else 'untied'} "
            f"ctx{c['block_size']} vocab{c['vocab_size']}")
