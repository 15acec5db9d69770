"""A monitor's parts, built once from its validated config: the publication and its reporter, the run's state, the rank
reducer (several ranks, ``distributed="merge"``), the stitcher, the edit-distance worker, the flight recorder
(``recorder_dir``), the reading set (``reading_rows``), the stages that drive them, and the scrape endpoint (served
on rank 0)."""

from __future__ import annotations

import functools
import ipaddress
import logging
from collections.abc import Callable

from prometheus_client.registry import CollectorRegistry

from grpo_exporter import catalog
from grpo_exporter.ranks import distributed
from grpo_exporter.ranks.layout import Layout
from grpo_exporter.recorder.flight import FlightRecorder
from grpo_exporter.recorder.reading_doc import respond
from grpo_exporter.recorder.reading_set import ReadingSet
from grpo_exporter.recorder.store import FreeFloor
from grpo_exporter.runtime.anchors import RunAnchors
from grpo_exporter.runtime.background import EditDistanceWorker
from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.runtime.reporting import Reporter
from grpo_exporter.runtime.run_info import static_values
from grpo_exporter.runtime.run_state import RunState
from grpo_exporter.runtime.stages import STAGE_BLOCKS, Stages
from grpo_exporter.serving.endpoint import Endpoint, Listen
from grpo_exporter.serving.publication import Publication
from grpo_exporter.serving.server import PortInUseError
from grpo_exporter.serving.targets import Announcement, advertised_host, bind_host
from grpo_exporter.step import families_of
from grpo_exporter.stitching import StepStitcher

log = logging.getLogger("grpo_exporter")
_ROLLOUTS = catalog.metric("grpo_reading_rollouts")


def _flight_recorder(config: MonitorConfig, rank: int, world: int, publication: Publication, report: Reporter,
                     decode: Callable[[list[int]], str] | None) -> FlightRecorder | None:
    """The flight recorder ``recorder_dir`` asks for (None without one)."""
    if config.recorder_dir is None:
        return None
    return FlightRecorder(
        config.recorder_dir, run=config.run, rank=rank, world=world, rows=config.recorder_rows,
        history_steps=config.recorder_history_steps, budget_bytes=config.recorder_disk_budget_bytes,
        triggers=config.recorder_triggers, lines=config.stop_lines, flush_timeout_s=config.recorder_flush_timeout_s,
        cooldown_steps=config.recorder_cooldown_steps,
        floor=FreeFloor(config.recorder_min_free_bytes, config.recorder_min_free_ratio),
        state_bytes=config.recorder_max_state_bytes, publication=publication,
        on_error=lambda exc: report.error("recorder", exc, "flight recorder"), decode=decode, metrics=config,
    )


def _reading_set(config: MonitorConfig, rank: int, world: int, publication: Publication, report: Reporter,
                 decode: Callable[[list[int]], str] | None) -> ReadingSet | None:
    """The reading set ``reading_rows`` asks for (None at 0)."""
    if not config.reading_rows:
        return None
    return ReadingSet(run=config.run, rank=rank, world=world, rows=config.reading_rows,
                      window_steps=config.reading_window_steps, windows=config.reading_windows,
                      text=config.reading_text, group_size=config.group_size, decode=decode,
                      on_error=lambda exc: _thread_error(report, publication, "reading", "reading set", exc))


def _link_reading(reading: ReadingSet | None, endpoint: Endpoint, publication: Publication) -> None:
    """Where the endpoint serves ``/reading``, publish how many rollouts it holds, labelled with the scheme the
    pages' links need (:func:`~grpo_exporter.mixin.promql.reading_link`)."""
    scheme = endpoint.scheme
    if reading is None or scheme is None:
        return
    key = _ROLLOUTS.key(scheme=scheme)
    reading.on_held = lambda held: publication.commit(merge={key: float(held)}, families=[_ROLLOUTS.name])
    reading.on_held(reading.held_rows())


def _reducer(config: MonitorConfig, world: int, report: Reporter) -> distributed.Reducer | None:
    """The rank merge, with several ranks and ``distributed="merge"`` (one layout per stage)."""
    if world <= 1 or config.distributed != "merge":
        return None
    layouts = {stage: Layout(families_of(blocks), config) for stage, blocks in STAGE_BLOCKS.items()}
    reducer = distributed.Reducer(layouts, config.distributed_timeout_s)
    if not reducer.active:  # logged by the reducer; counted here
        report.count("distributed")
    return reducer


def _listen(config: MonitorConfig) -> Listen | None:
    """Where the serving rank listens (None: ``port=None``). An unset ``host`` binds 127.0.0.1, or with
    ``targets_dir`` the advertised address: other machines reach it there, and only there (an ``advertise_host``
    that is no address of this node, a NAT's or a name for loopback here, binds every interface:
    :func:`~grpo_exporter.serving.targets.bind_host`)."""
    if config.port is None:
        return None
    announce = None
    host = config.host or "127.0.0.1"
    if config.targets_dir is not None:
        advertised = advertised_host(config.host or "0.0.0.0", config.advertise_host)
        if config.host is None:
            host = advertised if config.advertise_host is None else bind_host(advertised)
            if config.advertise_host is None and ipaddress.ip_address(advertised).is_loopback:
                log.warning("grpo-exporter: this node has no address but loopback (%s): Prometheus on another "
                            "machine cannot reach the announced target; set advertise_host", advertised)
        announce = Announcement(config.targets_dir, config.targets_job, advertised, config.targets_labels,
                                config.targets_stale_after_s)
    return Listen(host, config.port, config.tls_cert, config.tls_key, config.basic_auth_user,
                  config.basic_auth_password_hash, announce)


def assemble(config: MonitorConfig, registry: CollectorRegistry,
             decode: Callable[[list[int]], str] | None) -> tuple[Stages, Endpoint]:
    """The stages over the run's parts, and its endpoint, serving (on rank 0, with a port) once the run's static
    values are published. Every rank builds the same parts at the same point of the program."""
    publication = Publication(RunAnchors(
        config.anchor_steps, {"grpo_regression_accuracy_ratio": config.regression_anchor_evaluations}))
    report = Reporter(publication, config)
    rank, world = distributed.world()
    if config.distributed == "rank0" and rank != 0:
        raise ValueError(f"distributed: expected a monitor on rank 0 only with distributed='rank0', got one "
                         f"constructed on rank {rank} of {world} (construct it under `if rank == 0`, or use "
                         "'merge' with a monitor on every rank)")
    edit_worker = EditDistanceWorker(
        publication, lambda exc: report.error("rollout", exc, "edit distance worker"), config.edit_distance_budget_s,
    )
    reading = _reading_set(config, rank, world, publication, report, decode)
    stages = Stages(config, RunState(config), publication, report, _reducer(config, world, report),
                    StepStitcher(config.max_pending_micro_steps), edit_worker,
                    _flight_recorder(config, rank, world, publication, report, decode), reading)
    publication.merge(static_values(config))
    publication.publish()
    try:
        endpoint = Endpoint(publication, config.run, registry, lambda exc: report.error("scrape", exc),
                            _listen(config) if rank == 0 else None,
                            None if config.strict else lambda exc, port: _busy_port(report, exc, port, config),
                            None if config.strict else functools.partial(_thread_error, report, publication, "targets",
                                                                         "target file"),
                            (lambda query: respond(reading.document(), query)) if reading is not None else None)
        _link_reading(reading, endpoint, publication)
    except BaseException:  # a failed construction leaves no thread running and the registry as it was
        stages.stop_workers()
        raise
    return stages, endpoint


def _thread_error(report: Reporter, publication: Publication, stage: str, where: str, exc: BaseException) -> None:
    """A failure on a thread of its own (the target file's, the reading set's): counted, logged and published (no
    step publishes it)."""
    with publication.writing:
        report.error(stage, exc, where)
        publication.publish()


def _busy_port(report: Reporter, exc: PortInUseError, port: int, config: MonitorConfig) -> None:
    """A taken port never stops training: the endpoint serves on a free one, said here and counted."""
    report.count("scrape", publish=True)  # seen by the first scrape, on the port actually served
    where = (f"the target file in {config.targets_dir} names it" if config.targets_dir is not None else
             "Prometheus will not find it there: set targets_dir (file_sd discovery) or give each job on a node its "
             "own port")
    log.warning("grpo-exporter: %s; serving on the free port %d instead (GRPOMonitor.port; %s). "
                "Training continues; strict=True raises PortInUseError instead.", exc.strerror or exc, port, where)


__all__ = ["assemble"]
