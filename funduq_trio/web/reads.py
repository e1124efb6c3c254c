"""The read routes (DESIGN §5): `/runs/{run_id}`, `/threads/{thread_id}`,
`/agents`, `/healthz`, `/readyz`, and `/metrics` (Prometheus text, see
`broker/metrics.py`). JSON, camelCase; the facade returns the
shapes, this module only routes them. Unknown ids raise the broker's own
not-found errors, which the app answers 404 JSON."""

from __future__ import annotations

from typing import Any

from quart import Response, jsonify
from quart_trio import QuartTrio

from ..broker.errors import RunNotFound, UnknownThread
from ..broker.funduq import Funduq


def mount_reads(app: QuartTrio, funduq: Funduq) -> None:
    @app.get("/runs/<run_id>")
    async def get_run(run_id: str) -> Any:
        record = await funduq.get_run(run_id)
        if record is None:
            raise RunNotFound(f"no run {run_id!r}")
        return jsonify(record)

    @app.get("/threads/<thread_id>")
    async def get_thread(thread_id: str) -> Any:
        snapshot = await funduq.get_thread(thread_id)
        if snapshot is None:
            raise UnknownThread(f"no thread {thread_id!r}")
        return jsonify(snapshot)

    @app.get("/agents")
    async def get_agents() -> Any:
        return jsonify({"agents": await funduq.roster()})

    @app.get("/healthz")
    async def healthz() -> Any:
        return jsonify({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        """Ready when the broker runs and its store answers a query."""
        ready = await funduq.ready()
        response = jsonify({"status": "ready" if ready else "not ready"})
        response.status_code = 200 if ready else 503
        return response

    @app.get("/metrics")
    async def metrics() -> Response:
        text = funduq.metrics.render(funduq.gauges())
        return Response(text, content_type="text/plain; version=0.0.4; charset=utf-8")
