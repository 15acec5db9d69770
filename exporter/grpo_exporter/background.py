"""The in-group edit distance, computed on a worker thread so the training thread never waits for it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from grpo_exporter import catalog
from grpo_exporter.edit_distance import median_normalized_edit_distance, rows_to_groups
from grpo_exporter.publication import Publication


class EditDistanceWorker:
    """One job at a time: a rollout's sampled groups arrive while the previous job runs are skipped."""

    def __init__(self, publication: Publication, on_error: Callable[[BaseException], None]) -> None:
        self._publication = publication
        self._on_error = on_error
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-exporter-edit-distance")
        self._job: Future[None] | None = None

    def submit(self, carried: dict[str, list[float]], width: int) -> None:
        """Hand over the carried rows (``ed_ids``, ``ed_lengths``, ``ed_group``) of ``width`` tokens."""
        if "ed_ids" not in carried or (self._job is not None and not self._job.done()):
            return
        groups = rows_to_groups(carried["ed_ids"], carried["ed_lengths"], carried["ed_group"], width)
        self._job = self._pool.submit(self._run, groups)

    def _run(self, groups: list[list[list[int]]]) -> None:
        try:
            median = median_normalized_edit_distance(groups)
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
