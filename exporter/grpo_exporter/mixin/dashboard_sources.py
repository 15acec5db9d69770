"""Where a command's dashboards come from: rendered from the config with grafana-foundation-sdk when the
``dashboards`` extra is installed, else the JSON that ships inside the package.

The shipped JSON (``packaged_dashboards/``) is rendered from the default :class:`MixinConfig` by ``make
generate``, like the repository's ``dashboards/``; a test holds both to the builder. A config that changes a
setting the dashboards read (:data:`DASHBOARD_SETTINGS`) gets the shipped files all the same, with a note naming
the settings and the extra that would follow them: ``grpo-exporter kubernetes`` works on an install without the
SDK, and says so when its dashboards are not the config's.
"""

from __future__ import annotations

from importlib import metadata, resources

from grpo_exporter.mixin.config import MixinConfig

SDK = "grafana_foundation_sdk"
PACKAGED = "packaged_dashboards"
#: the settings the dashboards' thresholds and windows read; a test renders the dashboards with each setting of
#: MixinConfig changed and holds this set to those whose change shows
DASHBOARD_SETTINGS = frozenset({
    "clip_fraction_high", "engine_gap_healthy_nats", "engine_gap_jump_factor", "engine_gap_stop_nats",
    "ess_drop_factor", "fuse_hit_ratio", "gap_baseline_steps", "gap_clean_factor", "grad_clip_active_ratio",
    "grad_clip_carry_factor", "grad_spike_factor", "kl_growth_factor", "kl_runaway_min_nats", "lower_clip_min",
    "mismatch_kl_stop_nats", "noise_groups_max", "onpolicy_clip_stop_ratio", "pool_kept_max",
    "pool_overhead_growth", "rate_window_s", "routing_rise_factor", "staleness_max_versions", "step_seconds",
    "time_scale",
    "trend_window_steps", "truncation_surge_floor", "unique_ratio_min", "window_steps",
})


class SDKMissingError(RuntimeError):
    """grafana-foundation-sdk is not installed: the dashboards cannot be rendered, only the shipped ones read."""


def install_hint() -> str:
    """The commands that install the ``dashboards`` extra, with the SDK build it pins (read from this install's
    metadata)."""
    try:
        requires = metadata.requires("grpo-exporter") or []
    except metadata.PackageNotFoundError:  # a source tree without installation
        requires = []
    pins = [r.split(";")[0].strip() for r in requires if r.startswith("grafana-foundation-sdk") and "dashboards" in r]
    elsewhere = f", or pip install '{pins[0]}' where grpo-exporter came from a wheel" if pins else ""
    return f"pip install '.[dashboards]' in the repository{elsewhere} (docs/install.md)"


def rendered(config: MixinConfig) -> dict[str, str]:
    """File name -> JSON text of each dashboard rendered from ``config``; :class:`SDKMissingError` without the
    SDK."""
    try:
        from grpo_exporter.mixin.dashboards import dashboard_files
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != SDK:
            raise
        raise SDKMissingError("rendering the dashboards needs grafana-foundation-sdk, the dashboards extra: "
                             f"{install_hint()}") from None
    return dashboard_files(config)


def packaged() -> dict[str, str]:
    """File name -> JSON text of each dashboard shipped in the package (rendered from the default config)."""
    folder = resources.files("grpo_exporter.mixin").joinpath(PACKAGED)
    return {f.name: f.read_text(encoding="utf-8") for f in sorted(folder.iterdir(), key=lambda f: f.name)
            if f.name.endswith(".json")}


def unfollowed(config: MixinConfig) -> list[str]:
    """The settings the dashboards read that ``config`` changes from the defaults the shipped ones follow."""
    default = MixinConfig()
    return [name for name in sorted(DASHBOARD_SETTINGS) if getattr(config, name) != getattr(default, name)]


def dashboards_for(config: MixinConfig) -> tuple[dict[str, str], str | None]:
    """The dashboards for ``config``: rendered with the SDK, else the shipped ones; and a note for the user when
    the shipped ones do not follow settings ``config`` changes (None otherwise)."""
    try:
        return rendered(config), None
    except SDKMissingError:
        pass
    changed = unfollowed(config)
    if not changed:
        return packaged(), None
    return packaged(), ("note: grafana-foundation-sdk is not installed, so the dashboards are the ones shipped "
                        "with grpo-exporter, drawn for the default settings: their thresholds and windows do not "
                        f"follow your {', '.join(changed)}. To draw them from your config, install the dashboards "
                        f"extra: {install_hint()}.")
