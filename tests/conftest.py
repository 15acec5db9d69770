"""Shared test set-up: deterministic Hypothesis (same examples on every run, no example database), and the
background lane of the deterministic replays (tests/batch_lane.py)."""

import pytest
from hypothesis import settings

import batch_lane

settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.load_profile("deterministic")


#: modules whose tests read the background lane (tests/batch_lane.py): collected last, so that the lane has the
#: suite's idle CPU until they ask for their results
READ_THE_LANE = ("test_cadence.py", "test_worlds.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name in READ_THE_LANE)  # stable: the order is otherwise kept


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the background lane's jobs of the selected tests (each module's ``start_in_background``)."""
    if session.config.option.collectonly:
        return
    by_module: dict[object, list[pytest.Item]] = {}
    for item in session.items:
        by_module.setdefault(getattr(item, "module", None), []).append(item)
    for module, items in by_module.items():
        start = getattr(module, "start_in_background", None)
        if start is not None:
            start(items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    batch_lane.shutdown()
