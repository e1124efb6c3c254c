"""The read routes (DESIGN §5): `/runs/{run_id}`, `/threads/{thread_id}`,
`/runs` (a listing), `/agents`, `/healthz`, `/readyz`, and `/metrics`
(Prometheus text, see `broker/metrics.py`). JSON, camelCase; the facade returns
the shapes, this module only routes them. Unknown ids raise the broker's own
not-found errors, which the app answers 404 JSON.

Who may read what is the facade's question (DESIGN §8, `Funduq.may_read`):
a bound thread and its runs need the `Funduq-Proof` header or the operator
token, and without them answer exactly as an unknown id."""

from __future__ import annotations

from typing import Any

from quart import Response, jsonify, request
from quart_trio import QuartTrio
from werkzeug.exceptions import BadRequest

from ..broker.errors import RunNotFound, UnknownThread
from ..broker.funduq import Funduq
from ..protocol import statuses
from .access import reader_of

#: The most runs one page of `GET /runs` holds (and its default).
MAX_RUNS_PAGE = 500
DEFAULT_RUNS_PAGE = 100


class InvalidQuery(BadRequest):
    error_code = "invalid_query"


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_RUNS_PAGE
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= MAX_RUNS_PAGE:
        raise InvalidQuery(f"limit is a whole number from 1 to {MAX_RUNS_PAGE}")
    return int(raw)


def _statuses(raw: str | None) -> list[str] | None:
    if raw is None:
        return None
    wanted = [s for s in raw.split(",") if s]
    unknown = [s for s in wanted if s not in statuses.ALL]
    if unknown or not wanted:
        raise InvalidQuery(f"status is a comma-separated list of {', '.join(sorted(statuses.ALL))}")
    return wanted


def mount_reads(app: QuartTrio, funduq: Funduq) -> None:
    @app.get("/runs/<run_id>")
    async def get_run(run_id: str) -> Any:
        record = await funduq.read_run(run_id, reader_of(funduq, request))
        if record is None:
            raise RunNotFound(f"no run {run_id!r}")
        return jsonify(record)

    @app.get("/runs")
    async def list_runs() -> Any:
        """`?thread=&agent=&provider=&status=&limit=&cursor=`, scoped as
        `Funduq.listing_scope` says; `{"runs", "nextCursor"}`, newest first."""
        args = request.args
        page = await funduq.run_page(
            reader_of(funduq, request),
            thread_id=args.get("thread"),
            provider=args.get("provider"),
            agent=args.get("agent"),
            status=_statuses(args.get("status")),
            limit=_limit(args.get("limit")),
            cursor=args.get("cursor"),
        )
        return jsonify(page)

    @app.get("/threads/<thread_id>")
    async def get_thread(thread_id: str) -> Any:
        snapshot = await funduq.read_thread(thread_id, reader_of(funduq, request))
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
