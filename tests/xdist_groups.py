"""Under xdist (`make test` runs `-n 2 --dist loadgroup`) a module's tests stay on one
worker, so module-scoped stacks start once and run their tests in file order; a test
marked with its own group (each chaos stack group, the netns tests together) keeps that
group. tests/unit/test_xdist_groups.py checks that xdist honours it."""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


