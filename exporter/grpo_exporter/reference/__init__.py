"""Reference pages generated from the code: the alert table, the framework x alert matrix, the configuration
references. ``grpo-exporter reference --out docs`` writes them; a test fails when a committed copy drifts."""

from __future__ import annotations

from grpo_exporter.mixin.config import MixinConfig


def reference_pages(c: MixinConfig, runbooks: str) -> dict[str, str]:
    """File name -> text of every generated reference page."""
    from grpo_exporter.reference.alert_table import alert_table
    from grpo_exporter.reference.config_docs import exporter_reference, rules_reference
    from grpo_exporter.reference.frameworks import framework_matrix
    from grpo_exporter.reference.inputs_docs import inputs_reference

    return {"alerts.md": alert_table(c, runbooks), "frameworks.md": framework_matrix(c),
            "config-exporter.md": exporter_reference(), "config-rules.md": rules_reference(),
            "inputs.md": inputs_reference()}
