"""The in-group edit distance, computed on a worker thread so the training thread never waits for it."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.edit_distance import median_normalized_edit_distance, pair_cap, rows_to_groups
from grpo_exporter.inputs import StepInputs
from grpo_exporter.publication import Publication


def edit_distance_carry(inputs: StepInputs, groups_sampled: int, group_size: int) -> dict[str, Tensor]:
    """The rows of the first ``groups_sampled`` groups (ids, lengths, group index) to bring to the host with
    the rollout's one transfer; empty when the inputs do not allow it."""
    lengths = inputs.completion_lengths
    if lengths is None and inputs.completion_mask is not None:
        lengths = inputs.completion_mask.sum(dim=1)
    if groups_sampled == 0 or inputs.completion_ids is None or lengths is None:
        return {}
    try:
        groups = inputs.groups(group_size)
    except ValueError:
        return {}  # the grouping error is counted by the group metric blocks
    if groups is None:
        return {}
    rows = torch.argsort(groups.index, stable=True)[: groups_sampled * group_size]
    return {"ed_ids": inputs.completion_ids[rows], "ed_lengths": lengths[rows], "ed_group": groups.index[rows]}


def lowest_priority() -> None:
    """Nice 19 for this thread (Linux schedules threads as tasks): on cores training keeps busy, the
    edit-distance job takes only what training leaves. Elsewhere, or when refused, it keeps the default."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class EditDistanceWorker:
    """One job at a time: a rollout's sampled groups arrive while the previous job runs are skipped. Each job
    is bounded by ``budget_s`` of wall time and a pair cap that shrinks as 1/T^2
    (:mod:`grpo_exporter.edit_distance`)."""

    def __init__(
        self, publication: Publication, on_error: Callable[[BaseException], None], budget_s: float = 0.02
    ) -> None:
        self._publication = publication
        self._on_error = on_error
        self._budget_s = budget_s
        self._jobs = 0
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="grpo-exporter-edit-distance", initializer=lowest_priority
        )
        self._job: Future[None] | None = None

    def submit(self, carried: dict[str, Tensor], width: int) -> None:
        """Hand over the carried rows (``ed_ids``, ``ed_lengths``, ``ed_group``) of ``width`` tokens."""
        if "ed_ids" not in carried or (self._job is not None and not self._job.done()):
            return
        self._jobs += 1
        self._job = self._pool.submit(self._run, carried, width, self._jobs)

    def _run(self, carried: dict[str, Tensor], width: int, job: int) -> None:
        try:
            groups = rows_to_groups(carried["ed_ids"], carried["ed_lengths"], carried["ed_group"], width)
            median, _ = median_normalized_edit_distance(
                groups, self._budget_s, pair_cap(width, self._budget_s), seed=job
            )
            family = catalog.metric("grpo_edit_distance_median_ratio")
            with self._publication.writing:
                self._publication.merge({} if median is None else {family.key(): median}, [family.name])
                self._publication.publish()
        except Exception as exc:
            with self._publication.writing:
                self._on_error(exc)
                self._publication.publish()

    def wait(self, timeout: float = 10.0) -> None:
        if self._job is not None:
            self._job.result(timeout=timeout)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
