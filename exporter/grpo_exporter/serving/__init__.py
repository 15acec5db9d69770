"""Serving: what Prometheus reads. The publication (immutable snapshots of the run's samples), the collector
that turns them into prometheus-client families, and the HTTP server (TLS, basic auth). Reads the catalogue only
(two debts are listed in tests/test_layers.py)."""
