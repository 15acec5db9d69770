"""The step's inputs and config, and what several metric blocks read, computed once per stage."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional import gradient, samples
from grpo_exporter.functional.groups import Groups
from grpo_exporter.functional.reading import SMALL, count, count_nonfinite, keep_bits, zeroed
from grpo_exporter.inputs import InputError, StepInputs


class Context:
    """The step's inputs, config, groups, and what several blocks read, computed once: each token input on
    the loss mask (fp32, 0 elsewhere), the loss tokens per row, the log ratio.

    With a ``tool_mask``, ``x.loss_mask`` is the loss mask off the tool positions: every reading (the engine
    gap and mismatch, ratios, clips, entropy, KL) is of the model's own tokens, whatever the loss covers; the
    loss mask as given stays in ``given_loss_mask``, which the mask audit reads (loss on tool output is its
    fault to find, not a reading's to absorb)."""

    def __init__(self, x: StepInputs, cfg: MetricsConfig) -> None:
        self.given_loss_mask = x.loss_mask
        if x.tool_mask is not None and x.loss_mask is not None:
            x = x.replaced(loss_mask=x.loss_mask & ~x.tool_mask)
        self.x, self.cfg = x, cfg
        self._masked: dict[str, Tensor] = {}
        self._nonfinite: dict[int, tuple[Tensor, Tensor]] = {}
        self._scratch: Tensor | None = None
        self.log_ratio = None
        if x.loss_mask is not None and x.logprobs is not None and x.old_logprobs is not None:
            difference = self.masked("logprobs") - self.masked("old_logprobs")
            self.log_ratio = gradient.log_ratio_of(difference, x.loss_mask, cfg.log_ratio_clamp)

    @functools.cached_property
    def keep(self) -> Tensor:
        """The loss mask as int32 words (:func:`~grpo_exporter.functional.reading.keep_bits`), built once."""
        assert self.x.loss_mask is not None  # read by blocks that need the loss mask only
        return keep_bits(self.x.loss_mask)

    def masked(self, name: str) -> Tensor:
        """Input ``name`` on the loss mask in fp32, 0 elsewhere (padding never enters arithmetic)."""
        if name not in self._masked:
            self._masked[name] = zeroed(getattr(self.x, name), self.keep)
        return self._masked[name]

    @functools.cached_property
    def row_tokens(self) -> Tensor:
        """(N,) loss tokens per row."""
        assert self.x.loss_mask is not None
        return count(self.x.loss_mask, dim=1)

    @functools.cached_property
    def tokens(self) -> Tensor:
        """The loss tokens (0-d)."""
        return self.row_tokens.sum()

    def nonfinite(self, t: Tensor) -> Tensor:
        """NaN / +-inf entries of ``t`` (0-d int64), counted once per tensor of the step (the non-finite input
        counters and the metrics that skip those tokens share the count). The counts of a stage's token
        tensors share one scratch tensor: it stays in cache, where a fresh one per count would not."""
        if id(t) not in self._nonfinite:
            scratch = None
            if t.dtype == torch.float32 and t.numel() >= SMALL:
                if self._scratch is None or self._scratch.shape != t.shape or self._scratch.device != t.device:
                    self._scratch = torch.empty_like(t, memory_format=torch.contiguous_format)
                scratch = self._scratch
            self._nonfinite[id(t)] = (t, count_nonfinite(t, scratch))  # the tensor is kept: its id stays its own
        return self._nonfinite[id(t)][1]

    @functools.cached_property
    def finite_ratio_tokens(self) -> Tensor:
        """The loss tokens with a finite log ratio (0-d int64): ``log_ratio.valid`` counted (its bools read in a
        quarter of the bytes a non-finite count of the log ratio would)."""
        assert self.log_ratio is not None
        return count(self.log_ratio.valid)

    @functools.cached_property
    def weights_log_ratio(self) -> gradient.LogRatio:
        """The log ratio the loss weights by: the token log ratio, or GSPO's sequence-level one on each loss
        token (``ratio_level="sequence"``); the importance weights, the ESS and the clip counts read it."""
        assert self.log_ratio is not None
        if self.cfg.ratio_level == "sequence":
            return gradient.sequence_log_ratio(self.log_ratio, self.row_tokens)
        return self.log_ratio

    @functools.cached_property
    def weight_tokens(self) -> Tensor:
        """The loss tokens with a finite weight (0-d int64): :attr:`finite_ratio_tokens` at token level."""
        weights = self.weights_log_ratio
        return self.finite_ratio_tokens if weights is self.log_ratio else count(weights.valid)

    @functools.cached_property
    def signs(self) -> samples.SignedRows:
        """The loss tokens (or rows) with a finite advantage, by sign: the token counts and the clip counts
        both read them. Only where ``advantages`` and ``loss_mask`` were given."""
        assert self.x.advantages is not None
        assert self.x.loss_mask is not None
        return samples.advantage_signs(self.x.advantages, self.x.loss_mask, self.cfg.zero_advantage_atol)

    @functools.cached_property
    def positions(self) -> Tensor | None:
        """(N, T) completion positions: ``completion_mask``, else t < ``completion_lengths`` (built once). With a
        ``tool_mask`` the lengths are the model's tokens and the completion spans them and the tool's replies:
        t < lengths + the row's tool tokens (a length that already counts them, which the audit names, then
        reaches that many positions past the end)."""
        x = self.x
        if x.completion_mask is not None:
            return x.completion_mask
        width = next((t.shape[1] for t in (x.loss_mask, x.completion_ids) if t is not None), None)
        if x.completion_lengths is None or width is None:
            return None
        lengths = x.completion_lengths
        if x.tool_mask is not None:
            lengths = lengths + count(x.tool_mask, dim=1)
        return gradient.completion_positions(lengths, width)

    @property
    def groups(self) -> Groups | None:
        """The prompt groups; a grouping error raises here, in the blocks that need groups, and only there: the
        same error object in each, so that it is counted once for the call (not once per block)."""
        made = self._grouping
        if isinstance(made, InputError):
            raise made
        return made

    @functools.cached_property
    def _grouping(self) -> Groups | InputError | None:
        try:
            return self.x.groups(self.cfg.group_size)
        except InputError as exc:
            return exc

    def _difference(self, a: str, b: str) -> Tensor | None:
        """Input ``a`` minus input ``b`` on the loss mask (fp32, 0 elsewhere), when both and the mask are given."""
        x = self.x
        if x.loss_mask is None or getattr(x, a) is None or getattr(x, b) is None:
            return None
        return self.masked(a) - self.masked(b)

    @functools.cached_property
    def gap_difference(self) -> Tensor | None:
        """rollout_logprobs - old_logprobs on the loss mask (the engine gap's)."""
        return self._difference("rollout_logprobs", "old_logprobs")

    @functools.cached_property
    def gap_tokens(self) -> Tensor:
        """The loss tokens where the engine gap's difference is finite (0-d): the gap's and the mismatch's count."""
        assert self.gap_difference is not None
        return self.tokens - self.nonfinite(self.gap_difference)

    @functools.cached_property
    def kl_difference(self) -> Tensor | None:
        """ref_logprobs - logprobs on the loss mask (the KL's)."""
        return self._difference("ref_logprobs", "logprobs")

    @functools.cached_property
    def witnesses(self) -> dict[str, Tensor]:
        """Per token input, the non-finite count of a difference it entered, which the step takes anyway (the
        log ratio, the engine gap, the KL's ref - logprobs): non-finite wherever the input is (NaN or inf in
        either side of a difference leaves NaN or inf), so 0 there means 0 in the input (:class:`Witnessed`)."""
        out: dict[str, Tensor] = {}
        if self.log_ratio is not None:
            out["logprobs"] = out["old_logprobs"] = self.tokens - self.finite_ratio_tokens
        if self.gap_difference is not None:
            out["rollout_logprobs"] = self.nonfinite(self.gap_difference)
            if self.cfg.rollout_logprob_nan == "nonfinite":  # unscored NaN would make it a witness of nothing
                out.setdefault("old_logprobs", out["rollout_logprobs"])
        if self.kl_difference is not None:
            out["ref_logprobs"] = self.nonfinite(self.kl_difference)
            out.setdefault("logprobs", out["ref_logprobs"])
        return out
