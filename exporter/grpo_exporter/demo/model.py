"""A tiny causal transformer with tied input/output embeddings."""

from __future__ import annotations

import torch
from torch import Tensor, nn

KVCache = list[tuple[Tensor, Tensor]]  # per layer: keys and values (B, heads, positions, head width)


def bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` as a bf16 GEMM computes it: bf16 operands, fp32 accumulation, the result rounded
    to bf16 (as cuBLAS with 32-bit compute, and PyTorch's own CPU kernel). On CPUs without bf16 instructions
    PyTorch's bf16 ``linear`` gives the same bits ~7x slower than this (tests/test_demo.py); other dtypes go
    through ``linear`` unchanged."""
    if x.dtype != torch.bfloat16:
        return nn.functional.linear(x, weight, bias)
    out = nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(torch.bfloat16)


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

    def decode_step(self, tokens: Tensor, cache: KVCache | None) -> tuple[Tensor, KVCache]:
        """The next-token logits (B, vocab) after ``tokens`` (B, t), with a key/value cache: the first call
        takes the whole prefix, each later call one new token. The rollout engine's own code path (as vLLM
        keeps a KV cache), written out from the same weights: in the engine's precision, a different
        implementation than the trainer's :meth:`forward`."""
        start = 0 if cache is None else cache[0][0].shape[2]
        t = tokens.shape[1]
        h = self.embed(tokens) + self.position(torch.arange(start, start + t, device=tokens.device))
        out: KVCache = []
        for i, layer in enumerate(self.blocks.layers):
            attn = layer.self_attn
            heads, width = attn.num_heads, h.shape[-1]
            q, k, v = bf16_linear(layer.norm1(h), attn.in_proj_weight, attn.in_proj_bias).split(width, -1)
            q, k, v = (x.view(x.shape[0], t, heads, width // heads).transpose(1, 2) for x in (q, k, v))
            if cache is not None:
                k, v = torch.cat([cache[i][0], k], dim=2), torch.cat([cache[i][1], v], dim=2)
            out.append((k, v))
            mixed = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
            h = h + bf16_linear(mixed.transpose(1, 2).reshape(h.shape[0], t, width), attn.out_proj.weight,
                                attn.out_proj.bias)
            hidden = layer.activation(bf16_linear(layer.norm2(h), layer.linear1.weight, layer.linear1.bias))
            h = h + bf16_linear(hidden, layer.linear2.weight, layer.linear2.bias)
        h = self.norm(h[:, -1])
        return bf16_linear(h, self.embed.weight), out

