"""The ``grpo-exporter`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, get_args

from grpo_exporter import __version__

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

    from grpo_exporter.mixin.config import MixinConfig

# what add_subparsers returns (argparse has no public name for it)
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
STEP_SECONDS_HELP = ("your run's typical seconds per training step (overrides the config's step_seconds; every "
                     "window, baseline and `for` is sized in steps from it)")


def _catalog(args: argparse.Namespace) -> int:
    from grpo_exporter.metric_docs import metrics_markdown

    text = metrics_markdown()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


def _mixin_config(args: argparse.Namespace) -> MixinConfig:
    """The config file's MixinConfig, with --step-seconds over its step_seconds; a file that does not load or
    validate exits with one line per problem, each naming the setting, what it expects and what came."""
    from pydantic import ValidationError

    from grpo_exporter.config_files import ConfigFileError
    from grpo_exporter.mixin.config import MixinConfig

    try:
        config = MixinConfig.load(args.config)
        if getattr(args, "step_seconds", None) is not None:
            config = MixinConfig.model_validate(config.model_dump() | {"step_seconds": args.step_seconds})
    except ConfigFileError as exc:
        raise SystemExit(f"grpo-exporter: error: {exc}") from None
    except ValidationError as exc:
        problems = "\n".join(f"grpo-exporter: error: --config {args.config}: {_problem(e)}" for e in exc.errors())
        raise SystemExit(problems) from None
    return config


def _problem(error: ErrorDetails) -> str:
    """One validation error as a line: the setting, what it expects, what came. What came is not echoed for an
    unknown key or anything under ``receivers`` (it may be a secret written in place: a Slack URL as
    ``slack_api_url``), and an unknown key of an integration that has ``<key>_file`` points to it."""
    from grpo_exporter.config_files import short_repr
    from grpo_exporter.mixin.receivers import Receiver

    where = ".".join(map(str, error["loc"]))
    message = error["msg"].removeprefix("Value error, ")
    if not where:
        return message
    if error["type"] == "extra_forbidden":
        parts, key = where.split("."), where.rsplit(".", 1)[-1]
        field = Receiver.model_fields.get(parts[2]) if len(parts) == 4 and parts[0] == "receivers" else None
        fields = get_args(field.annotation)[0].model_fields if field is not None else {}
        hint = (f"; a secret is read from a file, {key}_file, or in Kubernetes from a Secret key, {key}_secret "
                "(docs/receivers.md)" if f"{key}_file" in fields else
                f" ({'docs/receivers.md' if parts[0] == 'receivers' else 'docs/config-rules.md'} lists the settings)")
        return f"{where}: not a setting (its value is not shown){hint}"
    if where.startswith("receivers"):
        return f"{where}: {message} (the value is not shown: it may be a secret)"
    return f"{where}: {message}, got {short_repr(error['input'])}"


def _receiver_notes(config: MixinConfig, kubernetes: bool) -> None:
    from grpo_exporter.mixin.receiver_configs import notes

    for line in notes(config, kubernetes):
        print(line, file=sys.stderr)


def _rules(args: argparse.Namespace) -> int:
    from grpo_exporter.mixin.render import alertmanager_output, rules_outputs, write

    config = _mixin_config(args)
    # everything goes under a path the user named: with --out, alertmanager.yml too (unless placed elsewhere)
    rules_dir = Path(args.out or "rules")
    alertmanager_dir = Path(args.alertmanager_out or (args.out or "deploy/alertmanager"))
    for path in write(rules_outputs(config), rules_dir):
        print(f"wrote {path}")
    for path in write({"alertmanager.yml": alertmanager_output(config)}, alertmanager_dir):
        print(f"wrote {path}")
    _receiver_notes(config, kubernetes=False)
    return 0


def _dashboards(args: argparse.Namespace) -> int:
    from grpo_exporter.mixin.dashboard_sources import SDKMissingError, rendered
    from grpo_exporter.mixin.render import write

    try:
        files = rendered(_mixin_config(args))
    except SDKMissingError as exc:  # the SDK is an optional extra
        print(f"grpo-exporter dashboards: {exc}", file=sys.stderr)
        return 2
    for path in write(files, Path(args.out)):
        print(f"wrote {path}")
    return 0


def _kubernetes(args: argparse.Namespace) -> int:
    from grpo_exporter.mixin.dashboard_sources import dashboards_for
    from grpo_exporter.mixin.kubernetes import info_inhibitor_note, manifest_files, retire_old_files
    from grpo_exporter.mixin.render import write

    config = _mixin_config(args)
    dashboards, note = dashboards_for(config)
    if note:
        print(note, file=sys.stderr)
    try:
        files = manifest_files(config, dashboards)
    except ValueError as exc:
        print(f"grpo-exporter kubernetes: {exc}", file=sys.stderr)
        return 2
    for path in write(files, Path(args.out)):
        print(f"wrote {path}")
    for path, why in retire_old_files(Path(args.out), config):
        print(f"removed {path}: {why}", file=sys.stderr)
    if note := info_inhibitor_note(config):
        print(note, file=sys.stderr)
    _receiver_notes(config, kubernetes=True)
    return 0


def _reference(args: argparse.Namespace) -> int:
    from grpo_exporter.mixin.render import write
    from grpo_exporter.reference import reference_pages

    runbooks = Path(args.runbooks)
    if not runbooks.is_file():
        print(f"grpo-exporter reference: --runbooks: expected the runbooks file, got {str(runbooks)!r} (run it from "
              "the repository root)", file=sys.stderr)
        return 2
    for path in write(reference_pages(_mixin_config(args), runbooks.read_text(encoding="utf-8")), Path(args.out)):
        print(f"wrote {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    import signal

    from grpo_exporter.demo.main import run_demo

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # `kill` stops the demo like Ctrl-C: everything it started is shut down

    previous = signal.signal(signal.SIGTERM, terminate)
    # Ctrl-C always stops the demo, also when it was started where SIGINT is ignored (a shell's background job,
    # `cmd &`): Python installs its KeyboardInterrupt handler only when SIGINT is not ignored at start-up
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run_demo(args.scenario, args.inject_at, args.steps, not args.no_stack, args.seed, args.steps_per_second,
                 record=args.record)
    except ValueError as exc:
        print(f"grpo-exporter demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopped: the exporter, Prometheus and Alertmanager of this demo are shut down")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    return 0


def _hash_password(args: argparse.Namespace) -> int:
    import getpass

    from grpo_exporter.serving.settings import hash_password

    password = args.password if args.password is not None else getpass.getpass("password: ")
    print(hash_password(password))
    return 0


def _targets_prune(args: argparse.Namespace) -> int:
    from grpo_exporter.serving.targets import prune

    directory = Path(args.dir)
    if not directory.is_dir():
        print(f"grpo-exporter targets prune: {directory} is no directory", file=sys.stderr)
        return 2
    pruned = prune(directory, args.stale_after_s)
    for path in pruned.removed:
        print(f"removed {path}")
    for path, exc in pruned.failed:
        print(f"grpo-exporter targets prune: cannot remove {path}: {exc.strerror or exc}", file=sys.stderr)
    return 1 if pruned.failed else 0


def _bench(args: argparse.Namespace) -> int:
    import platform

    import torch

    from grpo_exporter import bench
    from grpo_exporter.bench.worker import worker_cost

    sizes = [int(float(s)) for s in args.sizes.split(",") if s]
    framework = [int(float(s)) for s in args.framework_sizes.split(",") if s]
    results, long = bench.run(sizes, args.rounds, args.long_steps, args.device, not args.cold_allocator, framework)
    allocator = "cold allocator" if args.cold_allocator else "malloc thresholds of a training process"
    print(f"grpo-exporter bench on {platform.machine()}, {torch.get_num_threads()} torch threads, torch "
          f"{torch.__version__}, device {args.device}; medians of {args.rounds} interleaved rounds; {allocator}\n")
    widths = [int(w) for w in args.worker_widths.split(",") if w]
    print(bench.table(results, long, [worker_cost(w) for w in widths]))
    if not args.eager_only:
        from grpo_exporter.bench import compiled

        shaped = [(size, "bench") for size in sizes] + [(size, "framework") for size in framework]
        print("\nThe compiled step (compile_step=\"auto\") against the eager step, same metric set:\n")
        print(compiled.table(compiled.run(shaped, args.rounds, torch.device(args.device))))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import json

    from grpo_exporter.recorder.inspect import InspectError, load, render

    try:
        manifest = load(Path(args.dir))
    except InspectError as exc:
        print(f"grpo-exporter inspect: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(manifest, indent=1) + "\n" if args.json else render(manifest, args.rows))
    return 0


def _read(args: argparse.Namespace) -> int:
    from grpo_exporter.recorder.reading_doc import ReadingQueryError, dumps, for_page, render_text
    from grpo_exporter.recorder.reading_source import ReadingSourceError, load, page_of

    alert, layer = page_of(args.source)
    try:
        page = for_page(load(args.source, args.user, args.ca_file), args.alert or alert, args.layer or layer,
                        args.windows)
    except (ReadingSourceError, ReadingQueryError) as exc:
        print(f"grpo-exporter read: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(dumps(page).decode() + "\n" if args.json else render_text(page, args.rows))
    return 0


def _scenario_names() -> list[str]:
    from grpo_exporter.demo.scenarios import SCENARIOS

    return list(SCENARIOS)


def _add_catalog(commands: Subparsers) -> None:
    catalog = commands.add_parser("catalog", help="print or write the metric reference generated from the catalogue")
    catalog.add_argument("--out", help="write to this file instead of stdout (e.g. docs/metrics.md)")
    catalog.set_defaults(run=_catalog)


def _add_rules(commands: Subparsers) -> None:
    rules = commands.add_parser("rules", help="generate the Prometheus rule files and the Alertmanager config")
    rules.add_argument("--config", help="a YAML MixinConfig (defaults otherwise)")
    rules.add_argument("--out", help="folder of every file written (default: rules/, and deploy/alertmanager/ "
                       "for alertmanager.yml: the repository layout)")
    rules.add_argument(
        "--alertmanager-out", help="folder of alertmanager.yml (default: --out, else deploy/alertmanager)"
    )
    rules.add_argument("--step-seconds", type=float, help=STEP_SECONDS_HELP)
    rules.set_defaults(run=_rules)


def _add_dashboards(commands: Subparsers) -> None:
    boards = commands.add_parser("dashboards", help="generate the Grafana dashboards (JSON)")
    boards.add_argument("--config", help="a YAML MixinConfig (defaults otherwise)")
    boards.add_argument("--out", default="dashboards", help="folder of the dashboards (default: dashboards)")
    boards.set_defaults(run=_dashboards)


def _add_kubernetes(commands: Subparsers) -> None:
    k8s = commands.add_parser("kubernetes", help="generate Prometheus Operator manifests (rules, dashboards, scrape)")
    k8s.add_argument("--config", help="a YAML MixinConfig (defaults otherwise)")
    k8s.add_argument("--out", default="deploy/kubernetes", help="folder of the manifests (default: deploy/kubernetes)")
    k8s.add_argument("--step-seconds", type=float, help=STEP_SECONDS_HELP)
    k8s.set_defaults(run=_kubernetes)


def _add_reference(commands: Subparsers) -> None:
    ref = commands.add_parser("reference", help="generate the reference pages: alerts, framework matrix, "
                              "configuration")
    ref.add_argument("--config", help="a YAML MixinConfig (defaults otherwise)")
    ref.add_argument("--step-seconds", type=float, help=STEP_SECONDS_HELP)
    ref.add_argument("--runbooks", default="docs/runbooks.md", help="the runbooks, whose 'Silent when' the alert "
                     "table quotes (default: docs/runbooks.md)")
    ref.add_argument("--out", default="docs", help="folder of the pages (default: docs)")
    ref.set_defaults(run=_reference)


def _add_demo(commands: Subparsers) -> None:
    demo = commands.add_parser("demo", help="a tiny GRPO run with an injected fault, Prometheus and Alertmanager")
    demo.add_argument("--scenario", default="engine-stale-weights", choices=_scenario_names(), metavar="SCENARIO",
                      help="fault to inject, or healthy (docs/demo.md); one of: " + ", ".join(_scenario_names()))
    demo.add_argument("--inject-at", type=int, default=None,
                      help="step at which the fault starts (default: the scenario's)")
    demo.add_argument("--steps", type=int, default=400, help="GRPO steps to run")
    demo.add_argument("--seed", type=int, default=None, help="default: the scenario's")
    demo.add_argument("--steps-per-second", type=float, default=None,
                      help="pace, so that Prometheus sees each phase (default: 2)")
    demo.add_argument("--no-stack", action="store_true", help="no Prometheus/Alertmanager: exporter and guard only")
    demo.add_argument("--record", metavar="DIR", help="flight recorder directory: layer-1 faults write an incident "
                      "there for `grpo-exporter inspect` (e.g. with --scenario exp-before-clamp)")
    demo.set_defaults(run=_demo)


def _add_bench(commands: Subparsers) -> None:
    bench = commands.add_parser("bench", help="the monitor's step cost against naive code and the one-pass floor")
    bench.add_argument("--sizes", default="1e4,6.4e4,2.56e5,1e6,4e6", help="loss tokens per step, comma-separated")
    bench.add_argument("--framework-sizes", default="6.4e4,1e6",
                       help="loss tokens per step of the framework-shaped step (separate micro-batch outputs, "
                            "T - 3, a multi-turn loss mask), comma-separated ('' = none)")
    bench.add_argument("--rounds", type=int, default=15, help="timed rounds per size (after two warm-up rounds)")
    bench.add_argument("--long-steps", type=int, default=10_000, help="small steps for the RSS and series check")
    bench.add_argument("--device", default="cpu", help="torch device of the synthetic step (e.g. cuda)")
    bench.add_argument("--cold-allocator", action="store_true",
                       help="skip freeing one 30 MiB block first: glibc's malloc as in a process that never "
                       "trained (it then gives memory back to the system after nearly every large step)")
    bench.add_argument("--eager-only", action="store_true",
                       help="skip the compiled step's table (compile_step=\"auto\" against the eager step)")
    bench.add_argument("--worker-widths", default="256,1024,4096",
                       help="completion widths T for the edit-distance job's cost, comma-separated ('' = skip)")
    bench.set_defaults(run=_bench)


def _add_inspect(commands: Subparsers) -> None:
    inspect = commands.add_parser("inspect", help="a flight-recorder incident: the three states, then the rows "
                                  "that drove the trigger")
    inspect.add_argument("dir", metavar="DIR", help="an incident directory, or a recorder_dir (its latest incident)")
    inspect.add_argument("--rows", type=int, default=20, help="rows of the first anomalous step to show (default 20)")
    inspect.add_argument("--json", action="store_true", help="print the incident's manifest as JSON, for tools")
    inspect.set_defaults(run=_inspect)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return int(text)


def _add_read(commands: Subparsers) -> None:
    read = commands.add_parser("read", help="the rollouts to read before the curves: a run's reading set, one "
                               "rollout at a time with its reward components")
    read.add_argument("source", metavar="SOURCE", help="the link a page gives (the exporter's /reading), a reading "
                      "file (reading-<run>-r<rank>.json), an incident directory, or a recorder_dir")
    read.add_argument("--alert", help="only the rollouts this alert's page needs (default: the link's)")
    read.add_argument("--layer", help="only the rollouts this layer's pages need, e.g. 2-reward")
    read.add_argument("--windows", type=_positive, default=None, help="the newest N windows only")
    read.add_argument("--rows", type=_positive, default=None, help="rows per kind and window to show")
    read.add_argument("--user", help="basic auth user; the password is read from GRPO_READ_PASSWORD")
    read.add_argument("--ca-file", type=Path, help="the CA bundle that signed the exporter's TLS certificate")
    read.add_argument("--json", action="store_true", help="print the reading set as JSON, for tools")
    read.set_defaults(run=_read)


def _add_hash_password(commands: Subparsers) -> None:
    hashing = commands.add_parser("hash-password", help="print a basic_auth_password_hash for the exporter config")
    hashing.add_argument("--password", help="the password (prompted for when omitted)")
    hashing.set_defaults(run=_hash_password)


def _stale_after(text: str) -> float:
    """``--stale-after-s``: at least the floor of ``targets_stale_after_s`` (a live exporter touches its file every
    minute: a shorter line would remove live targets)."""
    from grpo_exporter.serving.settings import MIN_STALE_AFTER_S

    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not seconds >= MIN_STALE_AFTER_S:
        raise argparse.ArgumentTypeError(f"expected at least {MIN_STALE_AFTER_S:g} (a live exporter touches its file "
                                         f"every minute), got {text}")
    return seconds


def _add_targets(commands: Subparsers) -> None:
    targets = commands.add_parser("targets", help="the target files that exporters write for Prometheus' "
                                  "file_sd_configs (targets_dir)")
    actions = targets.add_subparsers(dest="action", required=True)
    prune = actions.add_parser("prune", help="remove target files whose exporter stopped touching them (a crashed "
                               "run's): for a SLURM epilog or a timer")
    prune.add_argument("--dir", required=True, help="the targets directory (the exporters' targets_dir)")
    prune.add_argument("--stale-after-s", type=_stale_after, default="3600",
                       help="remove files not touched for this many seconds (default 3600, the exporters' "
                       "targets_stale_after_s; a serving exporter touches its file every minute)")
    prune.set_defaults(run=_targets_prune)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-exporter", description=__doc__)
    parser.add_argument("--version", action="version", version=f"grpo-exporter {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_catalog, _add_rules, _add_dashboards, _add_kubernetes, _add_reference, _add_demo, _add_bench,
                _add_inspect, _add_read, _add_hash_password, _add_targets):
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
