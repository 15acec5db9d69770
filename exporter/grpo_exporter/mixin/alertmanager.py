"""Alertmanager routing and inhibition, from the same config as the rules.

Routes: critical to the pager receiver, everything else to the default one, grouped by alert and run; info
notices (a state of the run, such as its clean engine gap above the seed's line) are sent once per run.
Inhibitions encode the signal chain: while a layer-1 *critical* fires for a run (the 0/1 gates: non-finite
values, a wrong loss mask, a ratio clipped before any update, the engine gap at its stop line: "the gradient
is not what you think"), the pages of layers 2-4 and of the optimizer family for that run are muted (their
curves mean nothing until it is fixed; the gates keep firing a trend window (20 steps) after their last
evidence, as long as any alert they mute may still fire from their time, see
``promql.Alert.rule``). A layer-1 warning (a drifting gap, the fuse) and the optimizer family
(grad-norm spikes, clipping on every step) mute nothing, so a warning never mutes a critical; and a critical
alert mutes the warning of the same family for the same run.
"""

from __future__ import annotations

from typing import Any

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import OPTIMIZER

DOWNSTREAM = (Layer.REWARD.value, Layer.SAMPLES.value, Layer.DIVERSITY.value, OPTIMIZER)


def alertmanager_config(c: MixinConfig) -> dict[str, Any]:
    return {
        "route": {
            "receiver": "default",
            "group_by": ["alertname", "run"],
            "group_wait": c.duration(c.group_wait_s) if c.group_wait_s else "0s",
            "group_interval": c.duration(c.group_interval_s),
            "repeat_interval": c.duration(c.repeat_interval_s),
            "routes": [
                {"receiver": "pager", "matchers": ['severity="critical"']},
                # a notice holds for a run (the clean gap above the seed's line): said once, never re-sent
                {"receiver": "default", "matchers": ['severity="info"'],
                 "repeat_interval": c.duration(c.notice_repeat_interval_s)},
            ],
        },
        "receivers": [
            {"name": "pager", "webhook_configs": [{"url": c.pager_webhook_url, "send_resolved": True}]},
            {"name": "default", "webhook_configs": [{"url": c.default_webhook_url, "send_resolved": True}]},
        ],
        "inhibit_rules": [
            {
                "source_matchers": [f'layer="{Layer.GRADIENT.value}"', 'severity="critical"'],
                "target_matchers": [f'layer=~"{"|".join(DOWNSTREAM)}"'],
                "equal": ["run"],
            },
            {
                "source_matchers": ['severity="critical"'],
                "target_matchers": ['severity="warning"'],
                "equal": ["family", "run"],
            },
        ],
    }
