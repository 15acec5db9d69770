"""The package's import contract, read from the source: a module imports only from its own layer or the layers
below it (tools > integrations > runtime > rank merge > step > config > catalogue), and serving reads the
catalogue only. docs/architecture.md describes the layers; the debts the contract still allows are listed
here, each with why, so that none is added unseen."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "exporter" / "grpo_exporter"

#: layer rank by module or folder (the longest matching prefix wins); serving is its own branch above the catalogue
LAYERS: dict[str, tuple[int, str]] = {
    "catalog": (0, "catalogue"), "thresholds": (0, "catalogue"), "ids": (0, "catalogue"),
    "settings": (0, "catalogue"), "config_files": (0, "catalogue"),
    "edit_distance": (0, "catalogue"), "functional.constants": (0, "catalogue"),
    "config": (1, "config"),
    "functional": (2, "step"), "inputs": (2, "step"), "input_fields": (2, "step"), "keywords": (2, "step"),
    "stitching": (2, "step"),
    "step": (2, "step"),
    "ranks": (3, "rank merge"),
    "runtime": (4, "runtime"), "recorder": (4, "runtime"), "checks": (4, "runtime"),
    "integrations": (5, "integrations"),
    "cli": (6, "tools"), "bench": (6, "tools"), "demo": (6, "tools"), "mixin": (6, "tools"),
    "metric_docs": (6, "tools"), "reference": (6, "tools"),
    "": (6, "tools"),  # the package itself re-exports the public API
    # paths kept for imports written before the runtime moved into its folder
    "monitor": (6, "tools"), "monitor_config": (6, "tools"), "guard": (6, "tools"),
}
SERVING = "serving"

#: imports the contract still allows, and why
DEBTS = {
    ("serving.publication", "runtime.anchors"): "the frozen early-window anchors are published with the gauges "
    "they freeze",
}


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> tuple[int, str]:
    if module.split(".")[0] == SERVING:
        return 3, "serving"
    matches = [p for p in LAYERS if module == p or (p and module.startswith(p + ".")) or (not p and not module)]
    assert matches, f"{module} has no layer: add it to LAYERS (and docs/architecture.md)"
    return LAYERS[max(matches, key=len)]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_exporter"):
            if node.module == "grpo_exporter":
                found |= {a.name for a in node.names if (PACKAGE / a.name).with_suffix(".py").exists()
                          or (PACKAGE / a.name).is_dir()}
            else:
                found.add(node.module.removeprefix("grpo_exporter").lstrip("."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("grpo_exporter").lstrip(".") for a in node.names
                      if a.name.startswith("grpo_exporter")}
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[_name(p) or "grpo_exporter" for p in MODULES])
def test_a_module_imports_only_its_own_layer_and_those_below(path: Path) -> None:
    module = _name(path)
    rank, layer = _layer(module)
    for imported in sorted(_imports(path) - {module}):
        if (module, imported) in DEBTS:
            continue
        their_rank, their_layer = _layer(imported)
        if layer == "serving":
            assert their_layer in ("catalogue", "serving"), f"{module} (serving) imports {imported} ({their_layer})"
        else:
            assert their_rank <= rank, f"{module} ({layer}) imports {imported} ({their_layer}), a layer above it"


def test_the_catalogue_imports_nothing_of_ours() -> None:
    assert not _imports(PACKAGE / "catalog.py")


def test_only_the_rank_merge_calls_collectives() -> None:
    """torch.distributed's collectives are called from distributed.py alone."""
    for path in MODULES:
        if _name(path) == "ranks.distributed":
            continue
        text = path.read_text(encoding="utf-8")
        for call in ("all_reduce(", "all_gather(", "broadcast(", "all_gather_object(", "new_group("):
            assert f"dist.{call}" not in text, (path, call)
            assert f"torch.distributed.{call}" not in text, (path, call)


def test_every_debt_is_still_an_import() -> None:
    """A debt paid off leaves the list: the contract gets stricter, never silently looser."""
    for module, imported in DEBTS:
        path = PACKAGE / f"{module.replace('.', '/')}.py"
        assert imported in _imports(path), (module, imported)


def test_the_paths_kept_from_before_the_move_are_the_same_objects() -> None:
    import grpo_exporter.guard as old_guard
    import grpo_exporter.monitor as old_monitor
    import grpo_exporter.monitor_config as old_config
    from grpo_exporter.runtime import guard, monitor, monitor_config

    assert old_monitor.GRPOMonitor is monitor.GRPOMonitor
    assert old_config.MonitorConfig is monitor_config.MonitorConfig
    assert old_guard.engine_verdict is guard.engine_verdict


def test_a_block_joins_the_stages_it_declares_and_no_list_names_it() -> None:
    """A metric is the catalogue and one block: the block's ``@produces(stages=...)`` puts it in its stages (no
    hand-kept list to forget), each layer module's blocks in definition order; an unknown stage is refused."""
    from grpo_exporter.step import compute
    from grpo_exporter.step.blocks import reward
    from grpo_exporter.step.registry import Block, produces

    blocks = [b for module in compute.LAYERS for b in vars(module).values() if isinstance(b, Block)]
    assert len(blocks) == 28
    for block in blocks:
        assert (block in compute.ROLLOUT_BLOCKS) == ("rollout" in block.stages), block.name
        assert (block in compute.UPDATE_BLOCKS) == ("update" in block.stages), block.name
    assert compute.ROLLOUT_BLOCKS.index(reward.lengths) < compute.ROLLOUT_BLOCKS.index(reward.agent_loop)

    @produces("grpo_completions_total", stages=("update",))
    def recount(out, ctx) -> None: ...

    reward.recount = recount  # a block added to a layer module runs in its stage, nothing else edited
    try:
        update = compute.stage_blocks("update")
        assert update[update.index(reward.advantages) + 1] is recount  # after reward's blocks, before samples'
        assert update[update.index(recount) + 1].compute.__module__ != reward.__name__
        assert recount not in compute.stage_blocks("rollout")
    finally:
        del reward.recount
    with pytest.raises(ValueError, match="stages"):
        produces("grpo_completions_total", stages=("later",))


#: the limits of issue 30 in lines of code (docstrings, comments and blank lines not counted)
LIMITS = {"module": 400, "class": 200, "function": 60}
#: declarative tables, exempt from the limits: one entry per row is their shape, and splitting one scatters it
TABLES = {
    ("catalog", "module"): "the metric catalogue: one Metric(...) row per family",
    ("mixin.config", "MixinConfig"): "the alert settings: one pydantic field per threshold, each with its why",
    ("mixin.dashboards", "training_health"): "the dashboard: one row per signal-chain question, one panel a line",
    ("mixin.rules", "recording_rules"): "the recording rules: one rule per series",
    ("mixin.alerts.diversity", "alerts"): "one layer's alerts: one Alert(...) per page",
    ("mixin.alerts.gradient", "alerts"): "one layer's alerts: one Alert(...) per page",
    ("mixin.alerts.reward", "alerts"): "one layer's alerts: one Alert(...) per page",
    ("mixin.alerts.samples", "alerts"): "one layer's alerts: one Alert(...) per page",
}


def _code_lines(path: Path) -> tuple[ast.Module, Callable[[int, int], int]]:
    source = path.read_text(encoding="utf-8")
    tree, lines = ast.parse(source), source.splitlines()
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                docstrings |= set(range(first.lineno, (first.end_lineno or first.lineno) + 1))

    def count(start: int, end: int) -> int:
        return sum(1 for i in range(start, end + 1) if i not in docstrings
                   and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))

    return tree, count


def test_no_module_class_or_function_outgrows_its_limit() -> None:
    """No module over 400 lines of code, no class over 200, no function over 60; the declarative tables are
    listed above with why (and the list holds only what needs it)."""
    too_long, used = [], set()
    for path in MODULES:
        module = _name(path)
        tree, count = _code_lines(path)
        found = [("module", "module", count(1, len(path.read_text(encoding="utf-8").splitlines())))]
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                found.append((node.name, kind, count(node.lineno, node.end_lineno or node.lineno)))
        for name, kind, lines in found:
            if lines > LIMITS[kind]:
                if (module, name) in TABLES:
                    used.add((module, name))
                else:
                    too_long.append(f"{module}: {kind} {name} has {lines} lines of code (limit {LIMITS[kind]})")
    assert not too_long, "\n".join(too_long)
    assert used == set(TABLES), f"tables within the limits: take them off the list: {set(TABLES) - used}"
