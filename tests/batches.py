"""Random ragged GRPO batches for tests: numpy arrays (the reference's view) and matching StepInputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from grpo_exporter.inputs import StepInputs

TOKEN_FLOATS = ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy")


@dataclass
class Batch:
    """All step inputs as numpy arrays: float64 views of exactly the values handed to the library."""

    arrays: dict[str, np.ndarray]
    components: dict[str, np.ndarray]
    scalars: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32

    def inputs(self, **overrides: Any) -> StepInputs:
        """The same batch as library inputs; token float tensors and advantages in ``self.dtype``."""
        kwargs: dict[str, Any] = {}
        for name, value in self.arrays.items():
            t = torch.from_numpy(value.copy())
            if t.is_floating_point():
                t = t.to(self.dtype if name in (*TOKEN_FLOATS, "advantages") else torch.float32)
            kwargs[name] = t
        kwargs["reward_components"] = {k: torch.from_numpy(v.copy()).float() for k, v in self.components.items()}
        kwargs.update(self.scalars)
        kwargs.update(overrides)
        return StepInputs(**kwargs)

    def healthy_inputs(self, **overrides: Any) -> StepInputs:
        """:meth:`inputs` with the loss mask cut to the positions where every token input is finite: no mask bug
        trains on a -inf padding position (the batch's row 7 does), as in a healthy step."""
        faulty = self.inputs(**overrides)
        finite = torch.stack([torch.isfinite(getattr(faulty, name)) for name in TOKEN_FLOATS]).all(dim=0)
        return self.inputs(**{**overrides, "loss_mask": faulty.loss_mask & finite})


def stored(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """What ``values`` become once stored in ``dtype``, as float64."""
    return torch.from_numpy(np.asarray(values, dtype=np.float64)).to(dtype).double().numpy()


def make_batch(
    seed: int,
    prompts: int = 6,
    group_size: int = 8,
    width: int = 24,
    dtype: torch.dtype = torch.float32,
    shuffled_groups: bool = False,
    token_advantages: bool = False,
    interleaved: bool = False,
) -> Batch:
    """A ragged batch with every input: mixed, all-correct and all-wrong groups, duplicate completions, an
    out-of-bound advantage, ratios on both sides of the clip range, -inf / NaN only in padding.

    ``interleaved``: a multi-turn loss mask: tool or observation spans of 1-4 tokens inside each completion are
    off the loss mask, and every token tensor holds NaN, +inf or -inf there (what an engine reports for tokens
    it did not sample), so the mask alternates along each row instead of being a prefix."""
    rng = np.random.default_rng(seed)
    n = prompts * group_size
    group_index = np.repeat(np.arange(prompts), group_size)
    group_p = rng.choice([0.0, 0.1, 0.3, 0.5, 0.9, 1.0], size=prompts)
    group_p[:2] = (0.0, 1.0)
    correct = rng.random(n) < group_p[group_index]
    fmt = stored(np.round(rng.random(n), 1), torch.float32)
    fmt[group_index == 0] = 0.5
    rewards = stored(correct + np.where(group_index < 2, 0.0, 0.1 * fmt), torch.float32)

    lengths = rng.integers(1, width + 1, size=n)
    lengths[:2] = (1, width)
    ids = rng.integers(0, 6, size=(n, width))
    for src, dst in ((4, 5), (8, 9), (8, 10)):  # duplicates inside groups 0 and 1; padding differs
        lengths[dst] = lengths[src]
        ids[dst, : lengths[src]] = ids[src, : lengths[src]]
    lengths[7] = min(lengths[7], width - 1)
    lengths[11] = max(lengths[11], 2)
    positions = np.arange(width)[None, :] < lengths[:, None]
    # mask bugs: row 6 masked whole, row 7 trains on one padding position (-inf there), row 11 skips a token
    loss_mask = positions.copy()
    loss_mask[6] = False
    loss_mask[7, lengths[7]] = True
    loss_mask[11, 0] = False
    tool = np.zeros_like(positions)
    if interleaved:
        for i in range(n):
            t = int(rng.integers(1, 4))
            while t < width:
                span = int(rng.integers(1, 5))
                tool[i, t : t + span] = True
                t += span + int(rng.integers(1, 6))
        tool &= positions
        loss_mask &= ~tool

    old = -rng.gamma(1.0, 1.0, size=(n, width))
    token = {
        "old_logprobs": old,
        "rollout_logprobs": old + rng.normal(0.0, 2e-3, size=(n, width)),
        "logprobs": old + rng.normal(0.0, 0.25, size=(n, width)),
        "ref_logprobs": old + rng.normal(0.0, 0.1, size=(n, width)),
        "entropy": rng.gamma(2.0, 0.5, size=(n, width)),
    }
    token = {k: stored(v, dtype) for k, v in token.items()}
    for name, value in token.items():
        value[~positions] = np.nan if name == "entropy" else -np.inf
        value[tool] = rng.choice([np.nan, np.inf, -np.inf], size=int(tool.sum()))

    adv = np.zeros(n)
    for g in range(prompts):
        r = rewards[group_index == g]
        std = r.std(ddof=1)
        adv[group_index == g] = (r - r.mean()) / (std + 1e-4) if std > 0 else 0.0
    adv[3] = 25.0  # far above (G-1)/sqrt(G)
    arrays: dict[str, np.ndarray] = {
        "rewards": rewards,
        "correct": correct,
        "truncated": lengths == width,
        "zero_variance_prob": stored(
            (group_p**group_size + (1 - group_p) ** group_size)[group_index], torch.float32
        ),
        "all_incorrect_prob": stored(((1 - group_p) ** group_size)[group_index], torch.float32),
        "completion_lengths": lengths.astype(np.int64),
        "completion_ids": ids.astype(np.int64),
        "loss_mask": loss_mask,
        **token,
        "advantages": stored(
            np.where(positions, adv[:, None], np.nan) if token_advantages else adv,
            dtype,
        ),
    }
    # a multi-turn loop's own counts, drawn apart so the batch's other values stay as they were
    loop = np.random.default_rng([seed, 1])
    arrays["turns"] = loop.integers(1, 6, size=n).astype(np.int64)
    arrays["partial"] = loop.random(n) < 0.25
    arrays["staleness"] = loop.integers(0, 4, size=n).astype(np.int64)  # versions since each oldest token
    components = {"correctness": correct.astype(np.float64), "format": fmt}
    if shuffled_groups:
        perm = rng.permutation(n)
        arrays = {k: v[perm] for k, v in arrays.items()}
        components = {k: v[perm] for k, v in components.items()}
        arrays["group_ids"] = (rng.permutation(1000)[:prompts] * 7 - 300)[group_index][perm].astype(np.int64)
    scalars = {
        "on_policy": True,
        "grad_norm_pre_clip": 2.5,
        "max_grad_norm": 1.0,
        "loss": 0.25,
        "policy_version": 7,
        "rollout_policy_version": 5,
        "tool_calls": int(arrays["turns"].sum()) - n,  # a tool call between consecutive turns
        "tool_failures": (int(arrays["turns"].sum()) - n) // 4,
        "aborted_completions": 2,  # cut by a weight sync: no response token, in no loss
        # a dynamic-sampling loop that generated three batches' worth of groups to fill this one
        "generated_groups": 3 * prompts,
        "filtered_all_correct_groups": prompts // 2,
        "filtered_all_incorrect_groups": prompts,
    }
    return Batch(arrays, components, scalars, dtype)
