"""Several real `funduq-trio serve` processes on one PostgreSQL (docs/cluster.md).

`Cluster` starts nodes as `python -m funduq_trio serve` child processes: each
on port 0 (its URL read from the start banner), with a data directory of its
own, all on one database -- the schema made for the current test
(`stores.database_url`) -- and a short lease, so a killed node's threads move
on quickly. Waiting is for observable conditions (`eventually`, with a
generous deadline), never a sleep then an assertion.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from reliability_support import SAFETY

#: The start banner's first line (server.banner).
BANNER = re.compile(r"funduq-trio \S* ?serving on (http://\S+)")


class Node:
    """One `serve` process of the cluster; its stderr drained into `lines`
    (and its log file) so it can never block."""

    def __init__(self, name: str, data_dir: Path, log_path: Path, **settings: Any) -> None:
        self.name = name
        self.data_dir = data_dir
        self.log_path = log_path
        self.settings = {"node_name": name, **settings}
        self.process: trio.Process | None = None
        self.url: str | None = None
        self.lines: list[str] = []
        self._serving = trio.Event()
        self.exited = trio.Event()

    @property
    def base_url(self) -> str:
        assert self.url is not None, f"{self.name} is not serving"
        return self.url

    @property
    def provider_url(self) -> str:
        return "ws" + self.base_url[len("http") :] + "/ws/provider"

    def a2a_url(self, provider: str, agent: str) -> str:
        return f"{self.base_url}/a2a/{provider}/{agent}"

    def agui_url(self, provider: str, agent: str) -> str:
        return f"{self.base_url}/agui/{provider}/{agent}"

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "funduq_trio", "serve", "--host", "127.0.0.1", "--port", "0"]
        args += ["--data-dir", str(self.data_dir)]
        for name, value in self.settings.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        return args

    async def start(self, nursery: trio.Nursery) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FUNDUQ_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.process = await trio.lowlevel.open_process(
            self.argv(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        nursery.start_soon(self._drain)
        with trio.move_on_after(SAFETY):
            await self._serving.wait()
        if self.url is None:
            self.kill9()
            raise AssertionError(f"{self.name} did not start:\n" + "\n".join(self.lines[-30:]))

    async def _drain(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        buffer = b""
        async with await trio.open_file(self.log_path, "ab") as log:
            async for chunk in self.process.stderr:
                await log.write(chunk)
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    line = raw.decode("utf-8", "replace")
                    self.lines.append(line)
                    found = BANNER.search(line)
                    if found and self.url is None:
                        self.url = found.group(1)
                        self._serving.set()
        await self.process.wait()
        self.exited.set()
        self._serving.set()

    def logged(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]

    def kill9(self) -> None:
        """SIGKILL: no shutdown path runs; its leases are left to lapse."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)

    async def stop(self) -> int | None:
        """SIGTERM and wait: the orderly shutdown."""
        if self.process is None:
            return None
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(SAFETY):
            await self.process.wait()
        if self.process.returncode is None:
            self.kill9()
            await self.process.wait()
        await self.exited.wait()
        return self.process.returncode


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
async def cluster(tmp_path: Path, database_url: str, **settings: Any) -> AsyncIterator[Cluster]:
    """A cluster whose nodes are all stopped (or killed) on the way out."""
    async with trio.open_nursery() as nursery:
        nodes = Cluster(tmp_path, database_url, nursery, **settings)
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
