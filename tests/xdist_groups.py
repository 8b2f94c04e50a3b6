"""Under xdist (`make test` runs `-n 2 --dist loadgroup`) the tests of a module that shares
a module-scoped fixture (a stack started once) stay on one worker and run in file order; a
module whose tests share nothing is spread over both workers, test by test. A test marked
with its own group (each chaos stack group, the netns tests together) keeps that group.
tests/unit/test_xdist_groups.py checks that xdist honours it."""

from __future__ import annotations

import pytest

_SHARED = frozenset({"module", "class", "package"})


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    shared = {_module(item) for item in items if _shares_a_fixture(item)}
    for item in items:
        if item.get_closest_marker("xdist_group") is None and _module(item) in shared:
            item.add_marker(pytest.mark.xdist_group(_module(item)))


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture wider than itself (per worker: session ones don't
    count). Unknown (not a plain test function): assume it does."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return True
    return any(d.scope in _SHARED for defs in info.name2fixturedefs.values() for d in defs)
