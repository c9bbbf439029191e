"""GPT-2 / Megatron-style pre-LayerNorm decoder-only transformers, tiny to 50B parameters.

Named configurations (parameters counted with tied embeddings and vocab 50257 unless noted;
total = V*h + S*h + L*(12*h^2 + 13*h) + 2*h):

=================  ======  ======  =====  =======  ======  ===============
builder            hidden  layers  heads  seq_len  vocab   parameters
=================  ======  ======  =====  =======  ======  ===============
``gpt_tiny``           64       2      4       32     512  134,912
``gpt2_small``        768      12     12     1024   50257  124,439,808
``gpt2_medium``      1024      24     16     1024   50257  354,823,168
``megatron_1_2b``    1536      40     16     1024   50257  1,212,031,488
``megatron_2_5b``    1920      54     20     1024   50257  2,488,598,400
``megatron_8_3b``    3072      72     24     1024   50257  8,314,143,744
``gpt_50b``          8192      62     64     1024   50257  50,355,707,904
=================  ======  ======  =====  =======  ======  ===============

``gpt_50b`` is the 50B model of the ZeRO-Infinity paper (Rajbhandari et al., SC21).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` with PyTorch's default N(0, 1) init, skipped on the meta device.

    PyTorch's meta-device ``normal_`` imports ``torch._dynamo`` (about 1 s and 75 MB on first use),
    so the weight is created here and initialised only when it has real storage; the result, RNG
    stream included, matches ``nn.Embedding(num_embeddings, dim)``.
    """
    weight = torch.empty(num_embeddings, dim)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding.from_pretrained(weight, freeze=False)


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention: fused qkv Linear, SDPA (no attn dropout), out Linear."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.hidden = hidden
        self.heads = heads
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        q, k, v = self.qkv(x).split(self.hidden, dim=2)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, self.hidden)
        return self.dropout(self.proj(y))


class MLP(nn.Module):
    """Feed-forward: Linear(h, 4h), GELU (tanh approximation), Linear(4h, h), dropout."""

    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.gelu = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, dropout, pre-LN blocks, final LayerNorm, LM head."""

    def __init__(
        self,
        hidden: int,
        layers: int,
        heads: int,
        seq_len: int,
        vocab: int,
        dropout: float,
        tie_embeddings: bool,
    ) -> None:
        super().__init__()
        self.wte = embedding(vocab, hidden)
        self.wpe = embedding(seq_len, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.tie_embeddings = tie_embeddings
        self.lm_head: nn.Linear | None = (
            None if tie_embeddings else nn.Linear(hidden, vocab, bias=False)
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        # Static structure (fixed at construction), not data-dependent control flow.
        if self.lm_head is None:
            return F.linear(x, self.wte.weight)
        return self.lm_head(x)


def gpt(
    *,
    hidden: int,
    layers: int,
    heads: int,
    seq_len: int,
    vocab: int = 50257,
    dropout: float = 0.1,
    tie_embeddings: bool = True,
    device: str | torch.device = "meta",
) -> nn.Module:
    """Build a GPT-2 / Megatron-style decoder-only language model.

    Architecture: token embedding ``(vocab, hidden)`` plus learned position embedding
    ``(seq_len, hidden)``, dropout; ``layers`` pre-LayerNorm blocks, each
    ``x + Dropout(Linear(SDPA_causal(split(Linear(LN(x), 3h)))))`` then
    ``x + Dropout(Linear(GELU(Linear(LN(x), 4h)), h))``; final LayerNorm; LM head that reuses the
    token-embedding matrix when ``tie_embeddings`` (one shared Parameter) or a bias-free
    ``Linear(hidden, vocab)`` otherwise. Parameters with tied embeddings:
    ``vocab*h + seq_len*h + layers*(12*h^2 + 13*h) + 2*h``.

    Args:
        hidden: Model width ``h``; must be divisible by ``heads``.
        layers: Number of transformer blocks.
        heads: Attention heads.
        seq_len: Maximum sequence length (rows of the position embedding).
        vocab: Vocabulary size.
        dropout: Embedding and residual dropout probability (attention has none).
        tie_embeddings: Share the LM head with the token embedding.
        device: Where parameters live; ``"meta"`` (the default) allocates no memory.

    Returns:
        The model in train mode; input LongTensor ``(batch, s)`` with ``s <= seq_len``, output
        logits ``(batch, s, vocab)``.

    Raises:
        ValueError: If ``hidden % heads != 0`` or a size is not positive.

    Example:
        >>> model = gpt(hidden=64, layers=2, heads=4, seq_len=32, vocab=512, device="cpu")
        >>> model(torch.randint(0, 512, (2, 32))).shape
        torch.Size([2, 32, 512])
    """
    if min(hidden, layers, heads, seq_len, vocab) < 1:
        raise ValueError(
            f"gpt sizes must be positive: hidden={hidden}, layers={layers}, heads={heads}, "
            f"seq_len={seq_len}, vocab={vocab}"
        )
    if hidden % heads != 0:
        raise ValueError(f"gpt hidden={hidden} must be divisible by heads={heads}")
    with torch.device(device):
        return GPT(hidden, layers, heads, seq_len, vocab, dropout, tie_embeddings).train()


def gpt_tiny(
    *,
    seq_len: int = 32,
    vocab: int = 512,
    dropout: float = 0.1,
    device: str | torch.device = "meta",
) -> nn.Module:
    """Tiny GPT for tests: hidden 64, 2 layers, 4 heads; see :func:`gpt`.

    Example:
        >>> model = gpt_tiny(device="cpu")
    """
    return gpt(
        hidden=64, layers=2, heads=4, seq_len=seq_len, vocab=vocab, dropout=dropout, device=device
    )


def gpt2_small(
    *,
    seq_len: int = 1024,
    vocab: int = 50257,
    dropout: float = 0.1,
    device: str | torch.device = "meta",
) -> nn.Module:
    """GPT-2 small (124M): hidden 768, 12 layers, 12 heads; see :func:`gpt`.

    Example:
        >>> model = gpt2_small()  # meta device
    """
    return gpt(hidden=768, layers=12, heads=12, seq_len=seq_len, vocab=vocab,
               dropout=dropout, device=device)


def gpt2_medium(
    *,
    seq_len: int = 1024,
    vocab: int = 50257,
    dropout: float = 0.1,
    device: str | torch.device = "meta",
) -> nn.Module:
    """GPT-2 medium (355M): hidden 1024, 24 layers, 16 heads; see :func:`gpt`.

    Example:
        >>> model = gpt2_medium()  # meta device
    """
    return gpt(hidden=1024, layers=24, heads=16, seq_len=seq_len, vocab=vocab,
               dropout=dropout, device=device)


def megatron_1_2b(
    *,
    seq_len: int = 1024,
    vocab: int = 50257,
    dropout: float = 0.1,
    device: str | torch.device = "meta",
) -> nn.Module:
    """Megatron-LM 1.2B: hidden 1536, 40 layers, 16 heads; see :func:`gpt`.

    Example:
        >>> model = megatron_1_2b()  # meta device
    """
    return gpt(hidden=1536, layers=40, heads=16, seq_len=seq_len, vocab=vocab,
               dropout=dropout, device=device)


def megatron_2_5b(
    *,
    seq_len: int = 1024,
    vocab: int = 50257,
    dropout: float = 0.1,
    device: str | torch.device = "meta",
) -> nn.Module:
    """Megatron-LM 2.5B: hidden 1920, 54 layers, 20 heads; see :func:`gpt`.

    Example:
        >>> model = megatron_2_5b()  # meta device
    """
    return gpt(hidden=1920, layers=54, heads=20, seq_len=seq_len, vocab=vocab,
               dropout=dropout, device=device)


def megatron_8_3b(
    *,
    seq_len: int = 1024,
    vocab: int = 50257,
    dropout: float = 0.1,
    device: str | torch.device = "meta",
) -> nn.Module:
    """Megatron-LM 8.3B: hidden 3072, 72 layers, 24 heads; see :func:`gpt`.

    Example:
        >>> model = megatron_8_3b()  # meta device
    """
    return gpt(hidden=3072, layers=72, heads=24, seq_len=seq_len, vocab=vocab,
               dropout=dropout, device=device)


def gpt_50b(
    *,
    seq_len: int = 1024,
    vocab: int = 50257,
    dropout: float = 0.1,
    device: str | torch.device = "meta",
) -> nn.Module:
    """50B GPT of the ZeRO-Infinity paper: hidden 8192, 62 layers, 64 heads; see :func:`gpt`.

    Example:
        >>> model = gpt_50b()  # meta device: builds in well under a second, no weight memory
    """
    return gpt(hidden=8192, layers=62, heads=64, seq_len=seq_len, vocab=vocab,
               dropout=dropout, device=device)
