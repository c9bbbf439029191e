"""Post-LayerNorm BERT encoders with a masked-language-model head (BERT-base, BERT-large, tiny)."""

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


class SelfAttention(nn.Module):
    """Bidirectional multi-head self-attention: fused qkv Linear, unmasked SDPA, out Linear."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.heads = heads
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        q, k, v = self.qkv(x).split(self.hidden, dim=2)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.hidden))


class EncoderLayer(nn.Module):
    """Post-LN layer: x = LN(x + Dropout(attn(x))); x = LN(x + Dropout(Linear(GELU(Linear(x)))))."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.attn = SelfAttention(hidden, heads)
        self.attn_dropout = nn.Dropout(dropout)
        self.ln_1 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.gelu = nn.GELU()
        self.fc_out = nn.Linear(4 * hidden, hidden)
        self.ffn_dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn_dropout(self.attn(x)))
        return self.ln_2(x + self.ffn_dropout(self.fc_out(self.gelu(self.fc(x)))))


class BertForMaskedLM(nn.Module):
    """Word + position + token-type embeddings, LN, dropout; encoder layers; tied MLM head."""

    def __init__(
        self,
        hidden: int,
        layers: int,
        heads: int,
        seq_len: int,
        vocab: int,
        type_vocab: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.word_embeddings = embedding(vocab, hidden)
        self.position_embeddings = embedding(seq_len, hidden)
        self.token_type_embeddings = embedding(type_vocab, hidden)
        self.ln_emb = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads, dropout) for _ in range(layers))
        self.mlm_dense = nn.Linear(hidden, hidden)
        self.mlm_gelu = nn.GELU()
        self.mlm_ln = nn.LayerNorm(hidden)
        self.mlm_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.size(1), device=ids.device)
        token_types = torch.zeros_like(ids)
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        x = self.drop(self.ln_emb(x + self.token_type_embeddings(token_types)))
        for layer in self.layers:
            x = layer(x)
        x = self.mlm_ln(self.mlm_gelu(self.mlm_dense(x)))
        return F.linear(x, self.word_embeddings.weight, self.mlm_bias)


def bert(
    *,
    hidden: int,
    layers: int,
    heads: int,
    seq_len: int = 512,
    vocab: int = 30522,
    type_vocab: int = 2,
    dropout: float = 0.1,
    device: str | torch.device = "meta",
) -> nn.Module:
    """Build a post-LayerNorm BERT encoder with its masked-language-model head.

    Architecture: word ``(vocab, h)`` + position ``(seq_len, h)`` + token-type ``(type_vocab, h)``
    embeddings (token types are all zero, made inside forward), LayerNorm, dropout; ``layers``
    post-LN encoder layers (fused qkv Linear, unmasked scaled-dot-product attention, output
    Linear, dropout, residual, LN; then Linear(h, 4h), GELU, Linear(4h, h), dropout, residual,
    LN); MLM head Linear(h, h), GELU, LN, then a decoder that reuses the word-embedding matrix plus
    a separate ``(vocab,)`` bias. No pooler / NSP head. Parameters:
    ``(vocab + seq_len + type_vocab)*h + 2*h + layers*(12*h^2 + 13*h) + h^2 + 3*h + vocab``.

    Args:
        hidden: Model width ``h``; must be divisible by ``heads``.
        layers: Number of encoder layers.
        heads: Attention heads.
        seq_len: Maximum sequence length (rows of the position embedding).
        vocab: Vocabulary size.
        type_vocab: Token-type (segment) vocabulary size.
        dropout: Embedding, attention-output and FFN-output dropout probability.
        device: Where parameters live; ``"meta"`` (the default) allocates no memory.

    Returns:
        The model in train mode; input LongTensor ``(batch, s)`` with ``s <= seq_len``, output
        MLM logits ``(batch, s, vocab)``.

    Raises:
        ValueError: If ``hidden % heads != 0`` or a size is not positive.

    Example:
        >>> model = bert(hidden=64, layers=2, heads=4, seq_len=32, vocab=512, device="cpu")
        >>> model(torch.randint(0, 512, (2, 32))).shape
        torch.Size([2, 32, 512])
    """
    if min(hidden, layers, heads, seq_len, vocab, type_vocab) < 1:
        raise ValueError(
            f"bert sizes must be positive: hidden={hidden}, layers={layers}, heads={heads}, "
            f"seq_len={seq_len}, vocab={vocab}, type_vocab={type_vocab}"
        )
    if hidden % heads != 0:
        raise ValueError(f"bert hidden={hidden} must be divisible by heads={heads}")
    with torch.device(device):
        return BertForMaskedLM(hidden, layers, heads, seq_len, vocab, type_vocab, dropout).train()


def bert_tiny(
    *,
    seq_len: int = 32,
    vocab: int = 512,
    dropout: float = 0.1,
    device: str | torch.device = "meta",
) -> nn.Module:
    """Tiny BERT for tests: hidden 64, 2 layers, 4 heads, seq 32, vocab 512; see :func:`bert`.

    Example:
        >>> model = bert_tiny(device="cpu")
    """
    return bert(
        hidden=64, layers=2, heads=4, seq_len=seq_len, vocab=vocab, dropout=dropout, device=device
    )


def bert_base(
    *,
    seq_len: int = 512,
    vocab: int = 30522,
    dropout: float = 0.1,
    device: str | torch.device = "meta",
) -> nn.Module:
    """BERT-base: hidden 768, 12 layers, 12 heads (110M encoder parameters); see :func:`bert`.

    Example:
        >>> model = bert_base()  # meta device
    """
    return bert(
        hidden=768,
        layers=12,
        heads=12,
        seq_len=seq_len,
        vocab=vocab,
        dropout=dropout,
        device=device,
    )


def bert_large(
    *,
    seq_len: int = 512,
    vocab: int = 30522,
    dropout: float = 0.1,
    device: str | torch.device = "meta",
) -> nn.Module:
    """BERT-large: hidden 1024, 24 layers, 16 heads (335M encoder parameters); see :func:`bert`.

    Example:
        >>> model = bert_large()  # meta device
    """
    return bert(
        hidden=1024,
        layers=24,
        heads=16,
        seq_len=seq_len,
        vocab=vocab,
        dropout=dropout,
        device=device,
    )
