"""Several real `funduq-trio serve` processes on one PostgreSQL (docs/cluster.md).

`Cluster` starts nodes as `python -m funduq_trio serve` child processes: each
on port 0 (its URL read from the start banner), with a data directory of its
own, all on one database -- the schema made for the current test
(`stores.database_url`) -- and a short lease, so a killed node's threads move
on quickly. Waiting is for observable conditions (`eventually`, with a
generous deadline), never a sleep then an assertion.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import stores
import trio
from reliability_support import HTTP_TIMEOUT, ServerProcess

#: The nodes' lease: short enough that a killed node's threads (and push
#: configs) move on within a test, long enough that a busy host renews in time
#: (a lease is renewed every third).
LEASE = 2.0


class Node(ServerProcess):
    """One `serve` process of the cluster, on port 0, named ``name``."""

    def __init__(self, name: str, data_dir: Path, log_path: Path, **settings: Any) -> None:
        super().__init__(data_dir, 0, log_path, name=name, node_name=name, **settings)

    def a2a_url(self, provider: str, agent: str) -> str:
        return f"{self.base_url}/a2a/{provider}/{agent}"

    def agui_url(self, provider: str, agent: str) -> str:
        return f"{self.base_url}/agui/{provider}/{agent}"

    def client(self) -> httpx.AsyncClient:
        """An HTTP client of this node's doors and reads."""
        return httpx.AsyncClient(base_url=self.base_url, timeout=HTTP_TIMEOUT)


class Cluster:
    """Nodes on one database; `start()` adds one."""

    def __init__(self, tmp_path: Path, database_url: str, nursery: trio.Nursery, **settings: Any):
        self.tmp_path = tmp_path
        self.database_url = database_url
        self.nursery = nursery
        self.settings = settings
        self.nodes: list[Node] = []

    async def start(self, name: str, **settings: Any) -> Node:
        node = Node(
            name,
            self.tmp_path / f"data-{name}",
            self.tmp_path / f"{name}.log",
            database_url=self.database_url,
            **{**self.settings, **settings},
        )
        self.nodes.append(node)
        await node.start(self.nursery)
        return node


@asynccontextmanager
async def cluster(tmp_path: Path, **settings: Any) -> AsyncIterator[Cluster]:
    """A cluster on this test's database (each node's lease `LEASE` unless
    ``settings`` say otherwise), whose nodes are all killed on the way out."""
    assert stores.database_url is not None, "a cluster needs the PostgreSQL store"
    settings.setdefault("lease_seconds", LEASE)
    async with trio.open_nursery() as nursery:
        nodes = Cluster(tmp_path, stores.database_url, nursery, **settings)
        try:
            yield nodes
        finally:
            with trio.CancelScope(shield=True):
                for node in nodes.nodes:
                    node.kill9()
                for node in nodes.nodes:
                    if node.process is not None:
                        await node.process.wait()
            nursery.cancel_scope.cancel()


async def online(http: httpx.AsyncClient, fingerprint: str) -> bool:
    """Whether the node behind ``http`` lists the provider's agent online."""
    roster = (await http.get("/agents")).json()["agents"]
    return any(a["fingerprint"] == fingerprint and a["online"] for a in roster)


async def metric(http: httpx.AsyncClient, name: str) -> float:
    """One sample of `GET /metrics` (0 when absent)."""
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
