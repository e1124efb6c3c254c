"""The internal route between the nodes of a cluster (docs/cluster.md,
"Forwarding"): ``POST /internal/cluster/{op}``, signed with the cluster's
secret (``broker/cluster.py``). Anything unsigned, signed otherwise, stale
or taken before (each signed call is spent once across the cluster, in the
shared record's spent proofs) is refused 401 and changes nothing; on a
record of one process (SQLite) the route is not there (404).

A signed call runs the facade's own call with ``forwarded=True`` (so it is
carried out here, never sent on) and answers ``{"ok": result}`` or
``{"error": {class, message, details}}`` for a broker error, which the
forwarding node raises again as the same exception. ``kyok_complete`` (a
KYOK completion for a run led here) is answered as ``/kyok/v1/chat/completions``
answers, streamed as it comes, for the relaying node to pass on."""

from __future__ import annotations

import json
from typing import Any

from quart import Response, jsonify, request

from ..broker import cluster
from ..broker.errors import FunduqError, NotAuthorized, ProofsBusy, RecordUnavailable
from ..broker.funduq import Funduq
from ..identity import InvalidActorChain
from .kyok import complete_forwarded


def mount_cluster_route(app: Any, funduq: Funduq) -> None:
    from .app import json_error  # app.py mounts this module

    @app.post(cluster.ROUTE + "<op>")
    async def forwarded_call(op: str) -> Response:
        if not funduq.record.shared or op not in cluster.OPS:
            return json_error(404, "not_found", "no such route")
        body = await request.get_data()
        stamp = request.headers.get(cluster.TIME_HEADER)
        signature = request.headers.get(cluster.SIGNATURE_HEADER)
        refusal = json_error(
            401,
            "not_signed",
            "a call between funduq nodes must be signed with the cluster's secret, "
            "made now, and is taken once",
        )
        if not cluster.signed(funduq.cluster_secret, op, stamp, signature, body):
            return refusal
        assert stamp is not None and signature is not None
        try:
            # Spent before anything else: a captured call sent again, to this
            # node or another, is refused as any bad signature.
            await funduq.spend_cluster_call(stamp, signature)
        except NotAuthorized:
            return refusal
        except (RecordUnavailable, ProofsBusy) as exc:
            return json_error(503, "record_unavailable", str(exc))
        try:
            args = json.loads(body)
            if not isinstance(args, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            return json_error(400, "invalid_json", f"a forwarded call's body: {exc}")
        funduq.metrics.calls_taken += 1
        if op == "kyok_complete":
            # Answered as the KYOK route answers, streamed as it comes.
            return await complete_forwarded(funduq, args)
        try:
            result = await _carry_out(funduq, op, args)
        except (FunduqError, InvalidActorChain) as exc:
            return jsonify({"error": cluster.error_json(exc)})
        return jsonify({"ok": result})


async def _carry_out(funduq: Funduq, op: str, args: dict[str, Any]) -> Any:
    if op == "start_run":
        ticket = await funduq.start_run(
            args["provider"],
            args["agent"],
            args.get("run_input"),
            thread_id=args.get("thread_id"),
            metadata=args.get("metadata"),
            create_unknown_thread=bool(args.get("create_unknown_thread")),
            forwarded=True,
        )
        return {"runId": ticket.run_id, "threadId": ticket.thread_id}
    if op == "answer_pause":
        ticket = await funduq.answer_pause(
            args["run_id"],
            args.get("run_input"),
            metadata=args.get("metadata"),
            thread_id=args.get("thread_id"),
            forwarded=True,
        )
        return {"runId": ticket.run_id, "threadId": ticket.thread_id}
    return await funduq.cancel_run(args["run_id"], proof=args.get("proof"), forwarded=True)
