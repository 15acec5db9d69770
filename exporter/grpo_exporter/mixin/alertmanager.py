"""Alertmanager routing and inhibition, from the same config as the rules.

Routes: the always-firing GRPOWatchdog to the dead man's switch (the watchdog receiver) every
``watchdog_repeat_interval_s``; critical to the pager receiver, everything else to the default one, grouped by
alert and run; info notices (a state of the run, such as its clean engine gap above the seed's line) are sent once
per run.
Inhibitions encode the signal chain: while a layer-1 *critical* fires for a run (the 0/1 gates: non-finite
values, a wrong loss mask, a ratio clipped before any update, the engine gap at its stop line: "the gradient
is not what you think"), the pages of layers 2-4 and of the optimizer family for that run are muted (their
curves mean nothing until it is fixed; the gates keep firing a trend window (20 steps) after their last
evidence, as long as any alert they mute may still fire from their time, see
``promql.Alert.rule``). A layer-1 warning (a drifting gap, the fuse) and the optimizer family
(grad-norm spikes, clipping on every step) mute nothing, so a warning never mutes a critical; and a critical
alert mutes the warning of the same family for the same run. GRPOAdvantageAboveBound mutes
GRPOAdvantageInconsistent of its run: one advantage bug (a group normalised wrongly both leaves its bound and
stops summing to 0) pages once; GRPORoutingReplayFellBack mutes the engine-gap pages of its run (the experts
the replay lost open that gap).

Receivers (``receivers``: Slack, PagerDuty, email, Opsgenie, webhook) say what :mod:`~grpo_exporter.mixin.messages`
writes, and read every secret from a file (:mod:`~grpo_exporter.mixin.receivers`). A receiver with no integration
shows its alerts in Alertmanager's UI and API and sends them nowhere else (never to a placeholder URL that
swallows them); the generators say so on stderr. ``operator_config`` is the same routing as the Prometheus
Operator's ``AlertmanagerConfig`` resource, its secrets read from Kubernetes Secrets.
"""

from __future__ import annotations

import re
from typing import Any

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.alerts.liveness import WATCHDOG
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import OPTIMIZER
from grpo_exporter.mixin.receiver_configs import integrations, operator_integrations

OURS = 'alertname=~"GRPO.+"'
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
                # the dead man's switch: always firing, sent to its own receiver on its own beat, to nobody else
                {"receiver": "watchdog", "matchers": [f'alertname="{WATCHDOG}"'], "group_wait": "0s",
                 # checked every minute, re-sent once the repeat interval has passed (a group interval equal to it
                 # would let a tick land a moment early and skip a whole interval)
                 "group_interval": "1m", "repeat_interval": f"{c.watchdog_repeat_interval_s}s"},
                {"receiver": "pager", "matchers": ['severity="critical"']},
                # a notice holds for a run (the clean gap above the seed's line): said once, never re-sent
                {"receiver": "default", "matchers": ['severity="info"'],
                 "repeat_interval": c.duration(c.notice_repeat_interval_s)},
            ],
        },
        "receivers": [{"name": name, **integrations(c, name, receiver)}
                      for name, receiver in c.receivers.by_name().items()],
        "inhibit_rules": [
            {
                "source_matchers": [OURS, f'layer="{Layer.GRADIENT.value}"', 'severity="critical"'],
                "target_matchers": [OURS, f'layer=~"{"|".join(DOWNSTREAM)}"'],
                "equal": ["run"],
            },
            {  # ours only: another tool's alerts carry neither family nor run, which would compare equal
                "source_matchers": [OURS, 'severity="critical"'],
                "target_matchers": [OURS, 'severity="warning"'],
                "equal": ["family", "run"],
            },
            {  # a replay that fell back explains the engine gap it opens: one page, naming the cause
                "source_matchers": [OURS, 'alertname="GRPORoutingReplayFellBack"'],
                "target_matchers": [OURS, 'alertname=~"GRPOEngineLogprobGap(Critical|Warning)"'],
                "equal": ["run"],
            },
            {  # one advantage bug, one page: sequences over their bound already name the broken advantages
                "source_matchers": ['alertname="GRPOAdvantageAboveBound"'],
                "target_matchers": ['alertname="GRPOAdvantageInconsistent"'],
                "equal": ["run"],
            },
        ],
    }


MATCHER = re.compile(r'^(?P<name>[a-zA-Z_][a-zA-Z0-9_]*)(?P<op>=~|!~|!=|=)"(?P<value>.*)"$')
CAMEL = {"group_by": "groupBy", "group_wait": "groupWait", "group_interval": "groupInterval",
         "repeat_interval": "repeatInterval", "inhibit_rules": "inhibitRules", "source_matchers": "sourceMatch",
         "target_matchers": "targetMatch"}


def _matcher(text: str) -> dict[str, str]:
    found = MATCHER.match(text)
    if found is None:  # the matchers above are ours; a new form must be taught here
        raise ValueError(f"cannot convert the Alertmanager matcher {text!r} to the operator's form")
    return {"name": found["name"], "value": found["value"], "matchType": found["op"]}


def _operator_form(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {CAMEL.get(k, k): _operator_form(v, k) for k, v in value.items()}
    if isinstance(value, list):
        if key in ("matchers", "source_matchers", "target_matchers"):
            return [_matcher(m) for m in value]
        return [_operator_form(v) for v in value]
    return value


def operator_config(c: MixinConfig) -> dict[str, Any]:
    """The ``spec`` of an ``AlertmanagerConfig`` (monitoring.coreos.com/v1alpha1) with the same routing and
    inhibitions: the operator's schema is camelCase with matchers as objects. The operator routes to it only
    alerts whose ``namespace`` label is the resource's own (its default matcher strategy), which is why the
    Kubernetes PrometheusRule labels every alert with ``namespace`` (our alerts aggregate it away). Its route takes
    our alerts only: another alert of the namespace (a crash-looping trainer pod) keeps the routes it has."""
    plain = alertmanager_config(c)
    plain["route"]["matchers"] = [OURS]
    receivers = [{"name": name, **operator_integrations(c, name, receiver)}
                 for name, receiver in c.receivers.by_name().items()]
    return {"route": _operator_form(plain["route"]), "receivers": receivers,
            "inhibitRules": _operator_form(plain["inhibit_rules"])}
