"""The flight recorder (seed 第 6 篇 (crash triage) 三态保存): on the first anomalous step, the last normal step,
that step and the next one, with their metrics and a bounded sample of raw rows, written as one incident directory for
``grpo-exporter inspect``. On when ``recorder_dir`` is configured.

The package re-exports nothing: its settings, the incident store and ``inspect`` are read without torch (by the CLI
and the configuration reference), and only ``flight`` (the recorder itself) and ``triggers`` need it."""
