"""The per-run runtime: :class:`~grpo_exporter.runtime.monitor.GRPOMonitor` (inputs in, the step computed, the
run's state updated, readings published), its configuration, the run's state (``run_state``: solve rates, anchors,
spikes, components), the guard and its reporting, and the background workers."""
