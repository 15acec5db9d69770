"""A tiny causal transformer with tied input/output embeddings."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int, context: int = 16, width: int = 48, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.context = context

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits (B, T, vocab), causal."""
        t = tokens.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), diagonal=1)
        h = self.embed(tokens) + self.position(torch.arange(t, device=tokens.device))
        h = self.norm(self.blocks(h, mask=mask, is_causal=True))
        return h @ self.embed.weight.T  # tied output embedding
