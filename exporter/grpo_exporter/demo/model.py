"""A tiny causal transformer with tied input/output embeddings; with ``experts`` each layer's feed-forward block is a
mixture of experts (a linear router picks ``top_k`` of them per token, Mixtral's routing)."""

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


FP8 = torch.float8_e4m3fn  # an FP8 engine's GEMM operands (the weights stay bf16 between GEMMs)
FP8_MAX = 448.0  # e4m3's largest finite value


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` as an FP8 rollout engine computes it (W8A8, vLLM's fp8 quantisation): the weight
    quantised to e4m3 per output channel and the activations per token, each scaled to e4m3's range, products
    accumulated in fp32 and the result rounded to bf16."""
    out = nn.functional.linear(_e4m3(x.float()), _e4m3(weight.float()), None if bias is None else bias.float())
    return out.to(torch.bfloat16)


def _e4m3(t: Tensor) -> Tensor:
    """``t`` rounded to e4m3 with one scale per row (its largest magnitude maps to FP8_MAX), back in fp32."""
    scale = t.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (t / scale).to(FP8).float() * scale


def expert_matmul(x: Tensor, weight: Tensor, equation: str) -> Tensor:
    """``einsum(equation, x, weight)`` as :func:`bf16_linear` computes a bf16 GEMM: fp32 products, the result
    rounded to bf16 (other dtypes unchanged)."""
    if x.dtype != torch.bfloat16:
        return torch.einsum(equation, x, weight.to(x.dtype))
    return torch.einsum(equation, x.float(), weight.float()).to(torch.bfloat16)


class MoEFeedForward(nn.Module):
    """A mixture-of-experts feed-forward block: the router's ``top_k`` experts of each token, their outputs
    weighted by the softmax of the chosen scores. Every expert runs on every token (tiny sizes: simpler than a
    dispatch); only the chosen ones count."""

    def __init__(self, width: int, experts: int, top_k: int, hidden: int) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, width, hidden) / width**0.5)
        self.b_in = nn.Parameter(torch.zeros(experts, hidden))
        self.w_out = nn.Parameter(torch.randn(experts, hidden, width) / hidden**0.5)
        self.top_k = top_k

    def forward(self, x: Tensor, replay: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(output, chosen experts (B, T, k)) of ``x`` (B, T, width). ``replay`` (B, T, k) routes each token as
        given (routing replay) where all its ids are >= 0; elsewhere the router decides."""
        scores = bf16_linear(x, self.router.weight)
        chosen = scores.topk(self.top_k, dim=-1).indices
        if replay is not None:
            chosen = torch.where((replay >= 0).all(dim=-1, keepdim=True), replay, chosen)
        gates = torch.softmax(scores.float().gather(-1, chosen), dim=-1).to(x.dtype)
        hidden = torch.relu(expert_matmul(x, self.w_in, "btw,ewh->bteh") + self.b_in.to(x.dtype))
        out = expert_matmul(hidden, self.w_out, "bteh,ehw->btew")
        picked = out.gather(2, chosen.unsqueeze(-1).expand(*chosen.shape, out.shape[-1]))
        return (gates.unsqueeze(-1) * picked).sum(dim=2), chosen


class TinyLM(nn.Module):
    def __init__(self, vocab: int, context: int = 16, width: int = 48, layers: int = 2, heads: int = 4,
                 experts: int = 0, top_k: int = 2) -> None:
        """``experts`` > 0: each layer's feed-forward block is a :class:`MoEFeedForward` of that many experts (the
        encoder layer's own feed-forward then has width 1 and is never called)."""
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, heads, 1 if experts else 4 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.moe = (nn.ModuleList(MoEFeedForward(width, experts, top_k, width) for _ in range(layers)) if experts
                    else None)
        self.norm = nn.LayerNorm(width)
        self.context = context
        self.fp8 = False  # decode_step's GEMMs in FP8 (an FP8 engine's copy), the output projection in bf16

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits (B, T, vocab), causal."""
        if self.moe is not None:
            return self.routed(tokens)[0]
        t = tokens.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), diagonal=1)
        h = self.embed(tokens) + self.position(torch.arange(t, device=tokens.device))
        h = self.norm(self.blocks(h, mask=mask, is_causal=True))
        return h @ self.embed.weight.T  # tied output embedding

    def routed(self, tokens: Tensor, replay: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """An MoE model's logits (B, T, vocab) and the experts each position was routed to in each layer
        (B, T, layers, k); ``replay`` (same shape) replays a routing (:meth:`MoEFeedForward.forward`)."""
        assert self.moe is not None
        t = tokens.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), diagonal=1)
        h = self.embed(tokens) + self.position(torch.arange(t, device=tokens.device))
        routes = []
        for i, (layer, moe) in enumerate(zip(self.blocks.layers, self.moe, strict=True)):
            a = layer.norm1(h)
            h = h + layer.self_attn(a, a, a, attn_mask=mask, need_weights=False, is_causal=True)[0]
            out, chosen = moe(layer.norm2(h), None if replay is None else replay[:, :, i])
            h = h + out
            routes.append(chosen)
        return self.norm(h) @ self.embed.weight.T, torch.stack(routes, dim=2)

    def decode_step(self, tokens: Tensor, cache: KVCache | None) -> tuple[Tensor, KVCache, Tensor | None]:
        """The next-token logits (B, vocab) after ``tokens`` (B, t), with a key/value cache: the first call
        takes the whole prefix, each later call one new token. The rollout engine's own code path (as vLLM
        keeps a KV cache), written out from the same weights: in the engine's precision, a different
        implementation than the trainer's :meth:`forward`. An MoE model also returns the experts each of the
        ``t`` positions was routed to (B, t, layers, k), else None."""
        start = 0 if cache is None else cache[0][0].shape[2]
        t = tokens.shape[1]
        h = self.embed(tokens) + self.position(torch.arange(start, start + t, device=tokens.device))
        out: KVCache = []
        routes = []
        linear = fp8_linear if self.fp8 else bf16_linear
        for i, layer in enumerate(self.blocks.layers):
            attn = layer.self_attn
            heads, width = attn.num_heads, h.shape[-1]
            q, k, v = linear(layer.norm1(h), attn.in_proj_weight, attn.in_proj_bias).split(width, -1)
            q, k, v = (x.view(x.shape[0], t, heads, width // heads).transpose(1, 2) for x in (q, k, v))
            if cache is not None:
                k, v = torch.cat([cache[i][0], k], dim=2), torch.cat([cache[i][1], v], dim=2)
            out.append((k, v))
            mixed = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
            h = h + linear(mixed.transpose(1, 2).reshape(h.shape[0], t, width), attn.out_proj.weight,
                           attn.out_proj.bias)
            if self.moe is not None:
                mixed_out, chosen = self.moe[i](layer.norm2(h))
                h = h + mixed_out
                routes.append(chosen)
                continue
            hidden = layer.activation(linear(layer.norm2(h), layer.linear1.weight, layer.linear1.bias))
            h = h + linear(hidden, layer.linear2.weight, layer.linear2.bias)
        h = self.norm(h[:, -1])
        return bf16_linear(h, self.embed.weight), out, torch.stack(routes, dim=2) if routes else None

