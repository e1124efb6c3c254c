"""The operator's live page at `/` (DESIGN §8: it sees everything, so it
needs the operator token).

- `GET /` without the token: 401, a page that says how to get in.
- `GET /?token=…`: sets the operator cookie and redirects to `/` (the token
  leaves the address bar and the history).
- `GET /` with the token (header or cookie): the page. It is rendered here,
  in Python, whole; a few lines of inline JS fetch `/operator/view` (the same
  HTML, just the live part) every second and swap it in, so statuses change
  as runs move. Clicking a run shows its event timeline (`?run=ID`).
- `GET /operator/view[?run=ID]`: that live part (operator only).

Everything is read through the `Funduq` facade: `roster()`,
`provider_quality()`, `list_runs(...)`, `get_run(...)`. Every value from a
caller or provider is HTML-escaped on the way out.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

from quart import Response, redirect, request

from ..broker.funduq import Funduq
from .access import is_operator, remember_operator

__all__ = ["mount_operator_page", "render_view"]

#: How many of the newest runs the page lists.
RUNS_SHOWN = 50
#: How many events of one run the timeline shows (the newest are cut).
EVENTS_SHOWN = 500
#: One event's JSON, shortened past this on the page.
EVENT_CHARS = 300

STYLE = """
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.5em}
table{border-collapse:collapse}td,th{padding:.2em .6em;border-bottom:1px solid #ddd;
text-align:left;vertical-align:top}code{font-size:12px}
.status{font-weight:600}.completed{color:#070}.failed,.cancelled,.orphaned_by_restart{color:#b00}
.running,.offering{color:#05a}.queued,.paused{color:#a60}.online{color:#070}.offline{color:#999}
a.run{cursor:pointer}#timeline td{font-family:monospace;font-size:12px}
"""

SCRIPT = """
const live = document.getElementById('live');
async function refresh() {
  const run = new URLSearchParams(location.search).get('run');
  try {
    const r = await fetch('/operator/view' + (run ? '?run=' + encodeURIComponent(run) : ''),
                          {credentials: 'same-origin'});
    if (r.ok) { live.innerHTML = await r.text(); live.dataset.refreshed = Date.now(); }
  } catch (e) { /* the server restarting: try again next tick */ }
}
setInterval(refresh, 1000);
"""

UNAUTHORIZED = """<!doctype html><html><head><meta charset="utf-8">
<title>funduq: operator token needed</title></head><body>
<h1>funduq: the operator token is needed</h1>
<p>This page shows every run on this funduq, so it is for its operator.
Open the <b>operator page</b> address that <code>funduq-trio serve</code> prints
when it starts (<code>http://HOST:PORT/?token=…</code>), or add
<code>?token=</code> with the token kept in <code>operator.token</code> in the
data directory (or set as <code>FUNDUQ_OPERATOR_TOKEN</code>).</p>
</body></html>"""


def _e(value: Any) -> str:
    return escape("" if value is None else str(value))


def _status(status: str) -> str:
    return f'<span class="status {_e(status)}">{_e(status)}</span>'


def _roster_table(roster: list[dict[str, Any]]) -> str:
    rows = "".join(
        f"<tr><td>{_e(a['name'])}</td><td><code>{_e(a['fingerprint'])}</code></td>"
        f'<td class="{"online" if a["online"] else "offline"}">'
        f"{'online' if a['online'] else 'offline'}</td><td>{_e(a['description'])}</td></tr>"
        for a in roster
    )
    return (
        '<table id="agents"><tr><th>agent</th><th>provider</th><th></th>'
        f"<th>description</th></tr>{rows}</table>"
        if rows
        else "<p>No agents yet.</p>"
    )


def _providers_table(providers: list[dict[str, Any]]) -> str:
    if not providers:
        return "<p>No provider has attached yet.</p>"
    names = list(providers[0]["counters"])
    head = "".join(f"<th>{_e(n)}</th>" for n in names)
    rows = "".join(
        f"<tr><td><code>{_e(p['fingerprint'])}</code></td>"
        f'<td class="{"online" if p["online"] else "offline"}">'
        f"{'online' if p['online'] else 'offline'}</td>"
        + "".join(f"<td>{_e(p['counters'][n])}/{_e(p['allowance'])}</td>" for n in names)
        + "</tr>"
        for p in providers
    )
    return f'<table id="providers"><tr><th>provider</th><th></th>{head}</tr>{rows}</table>'


def _threads_table(runs: list[dict[str, Any]]) -> str:
    threads: dict[str, dict[str, Any]] = {}
    for run in runs:  # newest first: the first seen is the thread's latest run
        t = threads.setdefault(run["threadId"], {"latest": run, "runs": 0})
        t["runs"] += 1
    rows = "".join(
        f"<tr><td><code>{_e(tid)}</code></td><td>{_e(t['latest']['agent']['name'])}</td>"
        f"<td>{t['runs']}</td><td>{_status(t['latest']['status'])}</td></tr>"
        for tid, t in threads.items()
    )
    return (
        '<table id="threads"><tr><th>thread</th><th>agent</th><th>runs</th>'
        f"<th>latest run</th></tr>{rows}</table>"
        if rows
        else "<p>No threads yet.</p>"
    )


def _runs_table(runs: list[dict[str, Any]]) -> str:
    rows = "".join(
        f'<tr data-run="{_e(r["runId"])}"><td><a class="run" href="?run={_e(r["runId"])}">'
        f"<code>{_e(r['runId'])}</code></a></td><td><code>{_e(r['threadId'])}</code></td>"
        f"<td>{_e(r['agent']['name'])}</td><td>{_status(r['status'])}</td>"
        f"<td>{_e(r['createdAt'])}</td>"
        f'<td class="reason">{_e((r.get("metadata") or {}).get("failureReason"))}</td></tr>'
        for r in runs
    )
    return (
        '<table id="runs"><tr><th>run</th><th>thread</th><th>agent</th><th>status</th>'
        f"<th>created</th><th>failure reason</th></tr>{rows}</table>"
        if rows
        else "<p>No runs yet.</p>"
    )


def _timeline(run: dict[str, Any] | None, run_id: str) -> str:
    if run is None:
        return f"<h2>Run <code>{_e(run_id)}</code></h2><p>No such run.</p>"
    events = run.get("events") or []
    rows = []
    for item in events[:EVENTS_SHOWN]:
        event = item.get("event") or {}
        text = json.dumps(event, ensure_ascii=False)
        if len(text) > EVENT_CHARS:
            text = text[:EVENT_CHARS] + "…"
        rows.append(
            f"<tr><td>{_e(item.get('seq'))}</td><td>{_e(event.get('type'))}</td>"
            f"<td>{_e(text)}</td></tr>"
        )
    more = (
        f"<p>… and {len(events) - EVENTS_SHOWN} more events</p>"
        if len(events) > EVENTS_SHOWN
        else ""
    )
    reason = (run.get("metadata") or {}).get("failureReason")
    return (
        f"<h2>Run <code>{_e(run['runId'])}</code> {_status(run['status'])}</h2>"
        + (f'<p>failure reason: <b class="reason">{_e(reason)}</b></p>' if reason else "")
        + '<table id="timeline"><tr><th>seq</th><th>type</th><th>event</th></tr>'
        + "".join(rows)
        + "</table>"
        + more
    )


async def render_view(funduq: Funduq, run_id: str | None = None) -> str:
    """The live part of the page, as HTML."""
    runs = await funduq.list_runs(limit=RUNS_SHOWN)
    parts = [
        "<h2>Agents</h2>",
        _roster_table(await funduq.roster()),
        "<h2>Providers and their quality counters</h2>",
        _providers_table(funduq.provider_quality()),
        "<h2>Threads</h2>",
        _threads_table(runs),
        f"<h2>Runs (newest {RUNS_SHOWN})</h2>",
        _runs_table(runs),
    ]
    if run_id:
        parts.append(_timeline(await funduq.get_run(run_id), run_id))
    return "".join(parts)


def _html(body: str, status: int = 200) -> Response:
    response = Response(body, status=status, content_type="text/html; charset=utf-8")
    # The page shows what the operator token protects: never cached, never framed.
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Content-Security-Policy"] = (
        "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "frame-ancestors 'none'"
    )
    return response


def mount_operator_page(app: Any, funduq: Funduq) -> None:
    @app.get("/")
    async def operator_page() -> Response:
        if not is_operator(funduq, request, from_query=True):
            return _html(UNAUTHORIZED, 401)
        if "token" in request.args:
            return remember_operator(redirect("/", 303), funduq)
        run_id = request.args.get("run")
        view = await render_view(funduq, run_id)
        return _html(
            '<!doctype html><html><head><meta charset="utf-8"><title>funduq operator</title>'
            f"<style>{STYLE}</style></head><body><h1>funduq operator</h1>"
            f'<div id="live">{view}</div><script>{SCRIPT}</script></body></html>'
        )

    @app.get("/operator/view")
    async def operator_view() -> Response:
        if not is_operator(funduq, request):
            return _html(UNAUTHORIZED, 401)
        return _html(await render_view(funduq, request.args.get("run")))
