"""Fixtures for the tests on namespace hosts (netns_hosts.py).

Without root or namespace support these tests skip with the reason; with CI=true and
MILES_REQUIRE_NETNS=1 (set by .ci/run once it made a namespace) they fail instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from netns_hosts import Host, HostGroup, netns_problem


def skip_or_fail(require_env: str, problem: str) -> None:
    """Skip with ``problem``, or fail when CI promised the piece works (``require_env``=1)."""
    if os.environ.get("CI") == "true" and os.environ.get(require_env) == "1":
        pytest.fail(f"{require_env}=1 but {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="session")
def netns_ready() -> None:
    problem = netns_problem()
    if problem is not None:
        skip_or_fail("MILES_REQUIRE_NETNS", problem)


@pytest.fixture(scope="module")
def host_group(netns_ready) -> Iterator[HostGroup]:
    group = HostGroup.create(2, "run")
    try:
        yield group
    finally:
        group.destroy()


@pytest.fixture
def hosts(host_group: HostGroup) -> Iterator[list[Host]]:
    """Two hosts with their cables in and no process on them; the test's processes end with it."""
    for host in host_group.hosts:
        host.set_link(True)
        host.kill_all()
    try:
        yield host_group.hosts
    finally:
        for host in host_group.hosts:
            host.kill_all()
            host.set_link(True)
