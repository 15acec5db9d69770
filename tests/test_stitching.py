"""Micro-steps joined into one step: a view where they already lie one after another in one tensor (slices and
chunks of a batch tensor), a copy otherwise, and the same values either way."""

from __future__ import annotations

import pytest
import torch

from grpo_exporter.stitching import _joined


def _base(n: int = 12, t: int = 5) -> torch.Tensor:
    return torch.arange(n * t, dtype=torch.float32).reshape(n, t)


@pytest.mark.parametrize(
    "parts",
    [
        lambda b: [b[0:3], b[3:6], b[6:12]],  # slices, as TRL's micro-batches
        lambda b: list(b.chunk(4)),  # verl's DataProto.chunk
        lambda b: [b[0:4, :3], b[4:8, :3], b[8:12, :3]],  # a column-narrowed batch: rows still follow each other
        lambda b: [b[2:5], b[5:5], b[5:9]],  # an empty micro-batch in the middle
        lambda b: list(b[:, 0].chunk(3)),  # (N,) per-row fields whose stride is the row width
    ],
    ids=["slices", "chunk", "narrowed", "empty-part", "strided-1d"],
)
def test_adjacent_micro_batches_are_a_view_of_the_batch(parts):
    base = _base()
    values = parts(base)
    joined = _joined(values)
    assert torch.equal(joined, torch.cat(values))
    assert joined.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "parts",
    [
        lambda b: [b[3:6], b[0:3]],  # out of order
        lambda b: [b[0:3], b[4:7]],  # a gap
        lambda b: [b[0:3], b[3:6].clone()],  # another tensor
        lambda b: [b[0:3], b[3:6].double()],  # another dtype (cat promotes)
        lambda b: [b[0:1].expand(3, -1), b[0:1].expand(2, -1)],  # broadcast rows (stride 0)
        lambda b: [b[0:3, 0:2], b[3:6, 2:4]],  # same storage, other columns
    ],
    ids=["reordered", "gap", "other-tensor", "other-dtype", "stride-0", "other-columns"],
)
def test_anything_else_is_copied_and_equal(parts):
    base = _base()
    values = parts(base)
    joined = _joined(values)
    assert torch.equal(joined, torch.cat(values))
    assert joined.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
