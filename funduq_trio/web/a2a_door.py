"""The A2A door: `POST /a2a/{provider}/{agent}` (JSON-RPC 2.0, SSE for the
streaming methods) and `GET /a2a/{provider}/{agent}/.well-known/agent-card.json`.

A thin trio shell over `protocol/a2a/`, which owns every shape, the method
tables of both protocol versions, the status mapping and the errors; this
module only reads the request, calls the `Funduq` facade and writes the answer.
a2a-sdk's own server classes are asyncio-only, so none of them run here.

- Every answer is a JSON-RPC response at HTTP 200, errors included (as the
  a2a-sdk server answers), so a client always learns the code and message.
  The one exception is the card route: no such agent is a plain 404.
- A task is a run and its `contextId` is the run's thread. A task id only
  names tasks of the agent in the URL; any other run is "not found" here.
- Reads (`GetTask`, `SubscribeToTask`, `ListTasks`) see what the facade lets
  the caller read (DESIGN §8): a bound thread's tasks need the `Funduq-Proof`
  header (or the operator token) and are otherwise "not found", exactly as an
  unknown id; `ListTasks` without a `contextId` lists the threads bound to
  the key of a listing proof, everything for the operator, and nothing for
  anyone else. It is filtered, counted and paged in SQL.
- A message naming (`taskId`) a paused task answers the pause: the same task
  id continues. A message naming a task that is not paused (ended, or working)
  is refused with UnsupportedOperationError (A2A §3.1.1). A message naming no
  task is a new run on its `contextId`'s thread (a new thread without one; an
  unknown one is an invalid-params error).
- Request-level metadata (`params.metadata`: `actorChain`, `cancel`,
  `resolution`) goes to the broker; a message's own metadata binds nothing.
- A streaming call is checked and its run started *before* the SSE response
  begins, so every upfront error is an ordinary JSON answer. The stream opens
  with the Task snapshot, then the updates of each event as it is recorded,
  then the final status once the run settles or pauses. Every frame's SSE id
  is the run seq it reflects; SubscribeToTask with `Last-Event-ID` re-attaches
  after it, and a subscription to a paused task waits through the answer. A
  caller that goes away ends only its own stream, never the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from a2a.types import a2a_pb2 as pb
from a2a.utils import constants
from a2a.utils.errors import (
    A2AError,
    ContentTypeNotSupportedError,
    InternalError,
    InvalidParamsError,
    InvalidRequestError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from a2a.utils.task import decode_page_token, encode_page_token
from quart import Response, jsonify, request
from werkzeug.exceptions import NotFound, RequestEntityTooLarge

from .. import jose
from ..broker.errors import FunduqError, PushConfigNotFound, RunNotPaused
from ..broker.pushes import PushSlot
from ..broker.quiet import Quiet
from ..identity import InvalidActorChain
from ..protocol import statuses
from ..protocol.a2a.calls import (
    CANCEL,
    GET,
    LIST,
    PUSH_CREATE,
    PUSH_GET,
    PUSH_LIST,
    PUSH_OPS,
    REST,
    SEND,
    STREAM,
    SUBSCRIBE,
    V1,
    Call,
)
from ..protocol.a2a.card import agent_card
from ..protocol.a2a.listing import TaskPage, list_tasks_response
from ..protocol.a2a.messages import run_input_from_message
from ..protocol.a2a.parsing import CallRejected, parse_call
from ..protocol.a2a.projection import (
    TaskProjection,
    snapshot_of_record,
    status_of_state,
    task_from_record,
    task_state,
)
from ..protocol.a2a.render import error_response, result_response, stream_frame, stream_result
from .a2a_rest import mount_a2a_rest
from .access import of_agent, reader_of
from .door_errors import a2a_error
from .exchange import Answer, Json, Streamed, quart_response
from .sse import LAST_EVENT_ID, Identified, read_cursor

CARD_PATH = "/.well-known/agent-card.json"
JWKS_PATH = "/.well-known/jwks.json"

log = logging.getLogger("funduq_trio.a2a")

#: What the broker raises on purpose about a request (the rest are bugs).
CALLER_ERRORS = (FunduqError, InvalidActorChain)


def mount_a2a_door(app: Any, funduq: Any) -> None:
    """Add the A2A routes to `app`. `funduq` is the `Funduq` facade, or a
    zero-argument callable returning it (looked up per request)."""
    get_funduq: Callable[[], Any] = funduq if callable(funduq) else (lambda: funduq)

    async def rpc(provider: str, agent: str) -> Response:
        try:
            body = await request.get_data()
        except RequestEntityTooLarge:
            return quart_response(payload_too_large())
        door = A2ADoor(get_funduq(), provider, agent, request)
        return quart_response(await door.answer(body))

    app.add_url_rule("/a2a/<provider>/<agent>", "a2a_rpc", rpc, methods=["POST"])
    app.add_url_rule("/a2a/<provider>/<agent>/", "a2a_rpc_slash", rpc, methods=["POST"])

    async def card(provider: str, agent: str) -> Response:
        view = get_funduq().find_agent(provider, agent)
        if view is None:
            raise NotFound(f"no agent {agent!r} published by provider {provider!r}")
        rpc_url = f"{request.host_url.rstrip('/')}/a2a/{provider}/{agent}"
        return await _cacheable_card(
            jsonify(
                agent_card(
                    name=view.name,
                    description=view.description,
                    rpc_url=rpc_url,
                    rest_url=rpc_url,
                    published=view.card if isinstance(view.card, Mapping) else None,
                    identity=get_funduq().identity,
                )
            )
        )

    app.add_url_rule(f"/a2a/<provider>/<agent>{CARD_PATH}", "a2a_card", card, methods=["GET"])

    async def jwks() -> Response:
        # The key behind the card signatures and the push notifications' JWS.
        return jsonify(jose.jwks_of(get_funduq().identity))

    app.add_url_rule(JWKS_PATH, "jwks", jwks, methods=["GET"])
    mount_a2a_rest(app, get_funduq)


#: How long a caller may keep a card without asking again (A2A §8.6.1). A card
#: changes only when its provider republishes; a minute bounds how stale a
#: cached one gets, and revalidating it after that costs one 304.
CARD_MAX_AGE_SECONDS = 60


def _declares_json(mimetype: str) -> bool:
    """Whether a request's declared media type may carry a JSON-RPC body: the
    binding's `application/json` (A2A §9.1) or any `+json` type. A body that
    declares nothing is read as JSON; one declaring another type is refused
    with ContentTypeNotSupportedError (the TCK's JSONRPC-SSE-002)."""
    return not mimetype or mimetype == "application/json" or mimetype.endswith("+json")


async def _cacheable_card(response: Response) -> Response:
    """The card with the caching headers of A2A §8.6.1 (the TCK's
    CARD-CACHE-001/002): `Cache-Control: max-age` and an `ETag` that is a hash
    of the card as sent, so a conditional GET of an unchanged card is a 304."""
    response.headers["Cache-Control"] = f"max-age={CARD_MAX_AGE_SECONDS}"
    await response.add_etag()
    return await response.make_conditional(request)


def _json(payload: dict[str, Any]) -> Json:
    return Json(payload)


def payload_too_large() -> Json:
    """The answer to a body over the limit. The body is left unread: the
    connection must close after the answer."""
    return Json(
        error_response(None, InvalidRequestError(message="Payload too large")),
        headers={"Connection": "close"},
    )


class A2ADoor:
    """One JSON-RPC request at one agent's endpoint. `request` is what the
    door reads of the HTTP request besides its body (`web/exchange.py`)."""

    def __init__(self, funduq: Any, provider: str, agent: str, request: Any) -> None:
        self.funduq = funduq
        self.provider = provider
        self.agent = agent
        self.request = request
        self.view: Any = None

    async def answer(self, body: bytes) -> Answer:
        """The answer to the JSON-RPC request `body`: JSON, or a stream."""
        request = self.request
        if not _declares_json(request.mimetype):
            return _json(
                error_response(
                    None,
                    ContentTypeNotSupportedError(
                        message=f"Content-Type {request.mimetype!r} is not supported: "
                        "send the JSON-RPC request as application/json"
                    ),
                )
            )
        try:
            call = parse_call(body, request.headers.get("A2A-Version"))
        except CallRejected as rejected:
            return _json(rejected.response)
        except Exception as exc:
            log.exception("A2A request did not parse")
            return _json(error_response(None, InternalError(message=str(exc) or None)))
        try:
            self.view = self.funduq.find_agent(self.provider, self.agent)
            if self.view is None:
                raise InvalidRequestError(
                    message=f"No agent {self.agent!r} is published by provider "
                    f"{self.provider!r} at this funduq",
                    data={"reason": "agent_not_found"},
                )
            if call.streaming:
                quiet = Quiet()
                return Streamed(await self.open_stream(call, quiet), quiet)
            return _json(result_response(call, await self.perform(call)))
        except A2AError as exc:
            return _json(error_response(call, exc))
        except CALLER_ERRORS as exc:
            return _json(error_response(call, a2a_error(exc, task_id=_task_id(call))))
        except Exception as exc:
            log.exception("A2A %s failed", call.method)
            return _json(error_response(call, InternalError(message=str(exc) or None)))

    # -- the record, seen from this agent's endpoint

    def _ours(self, record: Mapping[str, Any] | None) -> bool:
        return of_agent(record, self.view.key, self.view.fingerprint, self.view.name)

    async def run_record(self, task_id: str) -> dict[str, Any]:
        """The task's record, for acts that carry their own authority (a
        cancel, an answer): whether the caller may *read* it is not asked."""
        record = await self.funduq.get_run(task_id)
        if not self._ours(record):
            raise TaskNotFoundError(data={"taskId": task_id})
        return record

    async def readable_record(self, task_id: str) -> dict[str, Any]:
        """The task's record if the caller may read it; otherwise exactly the
        answer to an unknown task."""
        record = await self.funduq.read_run(task_id, reader_of(self.funduq, self.request))
        if not self._ours(record):
            raise TaskNotFoundError(data={"taskId": task_id})
        return record

    # -- operations

    async def perform(self, call: Call) -> Any:
        if call.op == SEND:
            run_id = await self.deliver_with_push(call)
            blocking = not call.request.configuration.return_immediately
            record = (
                await self.funduq.wait_run(run_id)
                if blocking
                else await self.funduq.get_run(run_id)
            )
            # The projection, not its Task: the answer is usually written
            # from it directly (`render.result_response`).
            return snapshot_of_record(record)
        if call.op == GET:
            return task_from_record(await self.readable_record(call.request.id))
        if call.op == CANCEL:
            task_id = call.request.id
            await self.run_record(task_id)
            metadata = call.request_metadata() or {}
            record = await self.funduq.cancel_run(task_id, proof=metadata.get("cancel"))
            return task_from_record(record, cancel_requested=True)
        if call.op == LIST:
            return await self.list_tasks(call.request)
        if call.op in PUSH_OPS:
            return await self.push_config(call.op, call.request)
        raise InternalError(message=f"{call.method} has no handler")  # pragma: no cover

    async def push_config(self, op: str, req: Any) -> Any:
        """The push-config operations, on tasks of this agent only, for whoever
        may read the task (DESIGN §8): a push receives every update of the
        task, and a config holds its owner's token and credentials, so each of
        the four acts is a read of the task -- without the bound thread's
        proof (or the operator's token) it answers as an unknown task."""
        pushes = self.funduq.pushes
        await self.readable_record(req.task_id)
        if op == PUSH_CREATE:
            return await pushes.create(req.task_id, req, from_start=False)
        if op == PUSH_GET:
            return await pushes.get(req.task_id, req.id)
        if op == PUSH_LIST:
            return pb.ListTaskPushNotificationConfigsResponse(
                configs=await pushes.list(req.task_id)
            )
        with contextlib.suppress(PushConfigNotFound):
            # Deleting is idempotent (A2A §3.1.10, the TCK's PUSH-DEL-002): a
            # config already gone is the state asked for. The task is still
            # looked up above, so an unknown task stays "not found".
            await pushes.delete(req.task_id, req.id)
        return None

    async def deliver_with_push(self, call: Call) -> str:
        """`deliver`, and with a push config in the call's configuration: its
        target checked first, the config recorded for the task once there is one."""
        slot = await self._reserve_push(call)
        try:
            run_id = await self.deliver(call)
            await self._push_inline(call, slot, run_id)
        finally:
            if slot is not None:
                slot[1].release()
        return run_id

    async def _reserve_push(self, call: Call) -> InlinePush | None:
        """The call's inline push config, vetted with its room held -- all
        before the run starts, so nothing about it can fail after."""
        inline = _inline_push(call)
        if inline is None:
            return None
        task_id = call.request.message.task_id or None
        return inline, await self.funduq.pushes.reserve(inline, task_id)

    async def _push_inline(
        self,
        call: Call,
        slot: InlinePush | None,
        run_id: str,
    ) -> None:
        if slot is not None:
            answered = bool(call.request.message.task_id)
            await self.funduq.pushes.create(run_id, slot[0], from_start=not answered, slot=slot[1])

    async def deliver(self, call: Call) -> str:
        """Hand the call's message to the broker: the answer to the paused task
        it names, or a new run. Returns the task (run) id.

        A message naming a task is an answer or nothing (A2A §3.1.1): a task
        that ended cannot restart, and a working one takes no message (funduq
        cannot put one into a turn in flight), so either is refused with
        UnsupportedOperationError -- after the thread's authority check, which
        the broker's `answer_pause` runs before it looks at the run's state."""
        message: pb.Message = call.request.message
        metadata = call.request_metadata()
        thread_id = message.context_id or None
        if message.task_id:
            record = await self.run_record(message.task_id)
            interrupts = []
            if record.get("status") == statuses.INPUT_REQUIRED:
                interrupts = (record.get("metadata") or {}).get("interrupts") or []
            run_input = run_input_from_message(message, interrupts=interrupts)
            try:
                # A contextId that is not the task's is refused by the broker
                # after the authority check (refuse first, DESIGN §8).
                ticket = await self.funduq.answer_pause(
                    message.task_id, run_input, metadata=metadata, thread_id=thread_id
                )
            except RunNotPaused:
                # Ended, working, or answered meanwhile by someone else.
                raise await self._not_answerable(message.task_id) from None
            return ticket.run_id
        ticket = await self.funduq.start_run(
            self.view.key,
            self.view.name,
            run_input_from_message(message),
            thread_id=thread_id,
            metadata=metadata,
        )
        return ticket.run_id

    async def _not_answerable(self, task_id: str) -> UnsupportedOperationError:
        record = await self.run_record(task_id)
        state = pb.TaskState.Name(task_state(record["status"]))
        if record["status"] in statuses.TERMINAL:
            why = f"Task {task_id} is in terminal state: {state}"
        else:
            why = (
                f"Task {task_id} is not waiting for input ({state}); "
                "only an input-required task takes a message"
            )
        return UnsupportedOperationError(
            message=f"{why}. Send the message without taskId (same contextId) to start a new task."
        )

    async def list_tasks(self, req: pb.ListTasksRequest) -> pb.ListTasksResponse:
        """One page, as the SDK's task store pages (newest status first, a
        token naming the last task), but chosen, counted and cut in SQL."""
        page_size = req.page_size or constants.DEFAULT_LIST_TASKS_PAGE_SIZE
        after_ns = (
            req.status_timestamp_after.ToNanoseconds()
            if req.HasField("status_timestamp_after")
            else None
        )
        records, total, more = await self.funduq.task_page(
            self.view.key,
            self.view.name,
            reader_of(self.funduq, self.request),
            thread_id=req.context_id or None,
            status=sorted(status_of_state(req.status)) if req.status else None,
            status_after=None if after_ns is None else after_ns / 1e9,
            page_size=page_size,
            after_run=decode_page_token(req.page_token) if req.page_token else None,
        )
        token = encode_page_token(records[-1]["runId"]) if more and records else ""
        page = TaskPage(records, total, page_size, token)
        return list_tasks_response(req, page, records)

    # -- streams

    async def open_stream(self, call: Call, quiet: Quiet | None = None) -> AsyncIterator[list[Any]]:
        """Check the call and start what it asks for, then return the stream
        (everything that can fail upfront has failed by the time this returns).

        SubscribeToTask with `Last-Event-ID` re-attaches: no opening snapshot,
        the updates of the events after that seq, then the rest live (a task
        that ended meanwhile still gets its final status). Without it, it opens
        with the Task as it stands; an ended task is refused. A subscription
        at a pause waits through the answer (see `stream`)."""
        cursor = None
        if call.op == STREAM:
            slot = await self._reserve_push(call)
            try:
                run_id = await self.deliver(call)
                # Taken before anything else can happen to the run: the stream
                # then shows it from its arrival, however fast the provider is.
                record = self.funduq.live_record(run_id) or await self.funduq.get_run(run_id)
                await self._push_inline(call, slot, run_id)
            finally:
                if slot is not None:
                    slot[1].release()
        else:
            try:
                cursor = read_cursor(self.request.headers.get(LAST_EVENT_ID))
            except ValueError as exc:
                raise InvalidParamsError(message=f"{LAST_EVENT_ID}: {exc}") from None
            record = await self.readable_record(call.request.id)
            if record.get("status") in statuses.TERMINAL and cursor is None:
                state = pb.TaskState.Name(task_state(record["status"]))
                raise UnsupportedOperationError(
                    message=f"Task {call.request.id} is in terminal state: {state}"
                )
        recorded = max((e["seq"] for e in record.get("events") or ()), default=0)
        if cursor is not None:
            if cursor > recorded:
                raise InvalidParamsError(
                    message=f"{LAST_EVENT_ID}: {cursor} is past the task's last event ({recorded})"
                )
            seen = [e for e in record.get("events") or () if e["seq"] <= cursor]
            record = {**record, "events": seen}
        projection = TaskProjection.from_record(record)
        if cursor is not None:
            projection.last_seq = cursor
        # A subscriber that has seen the pause (the snapshot shows it, or its
        # cursor is past it) waits for the answer instead of closing at once.
        at_pause = (
            call.op == SUBSCRIBE
            and record.get("status") == statuses.INPUT_REQUIRED
            and projection.last_seq >= recorded
        )
        # A stream lasts as long as its run: it keeps what it frames with (the
        # call's id and dialect, the projection), not the parsed request, the
        # opening record or this door (its agent view).
        call = dataclasses.replace(call, request=None, params={})
        return A2ADoor.stream(
            self.funduq, call, projection, opening=cursor is None, at_pause=at_pause, quiet=quiet
        )

    @staticmethod
    async def stream(
        funduq: Any,
        call: Call,
        projection: TaskProjection,
        *,
        opening: bool = True,
        at_pause: bool = False,
        quiet: Quiet | None = None,
    ) -> AsyncIterator[list[Any]]:
        """The stream's responses in bursts (one burst = one write). Each frame's
        SSE id is the seq of the event behind it; the opening snapshot and the
        final status carry the last seq they reflect, so a caller re-attaching
        with any id it got misses nothing and sees nothing twice.

        It follows the run until the run ends or pauses. If the run is queued
        again by the time that is read (answered at once), it goes on through
        the new turn rather than close on a pause that is already over.

        With a `quiet` (`broker/quiet.py`) its waits end at the keepalive's
        deadline or when the caller goes, and it yields an empty burst then."""
        run_id = projection.task_id
        # Text deltas written without protobuf where the dialect allows.
        plain = call.dialect in (V1, REST)
        try:
            if opening:
                yield [_opening_frame(call, projection, plain)]
            if at_pause:
                while not await _reopened(funduq, run_id, projection.last_seq, quiet):
                    yield []
            while True:
                lane = funduq.lane_of(run_id)
                follow = funduq.follow(run_id, after_seq=projection.last_seq, quiet=quiet)
                async with contextlib.aclosing(follow) as bursts:
                    async for burst in bursts:
                        frames = _frames(call, projection, burst, plain)
                        if frames or not burst:  # an empty burst: the quiet's wait ended
                            yield frames
                # The lane's own record when it settled the run (no read).
                record = await funduq.record_after(run_id, lane)
                del lane
                if record is None:
                    raise TaskNotFoundError(data={"taskId": run_id})
                # What the record has beyond the follow (a run reopened while
                # it read the record): folded in, never skipped.
                frames = [
                    _framed(call, update, entry["seq"])
                    for entry in record["events"]
                    for update in projection.apply(entry["seq"], entry["event"])
                ]
                if frames:
                    yield frames
                status = record["status"]
                if status in statuses.TERMINAL or status == statuses.INPUT_REQUIRED:
                    break
                while not await _reopened(funduq, run_id, projection.last_seq, quiet):
                    yield []
            yield [_framed(call, projection.settle(record), projection.last_seq)]
        except A2AError as exc:
            yield [error_response(call, exc)]
        except CALLER_ERRORS as exc:
            yield [error_response(call, a2a_error(exc, task_id=run_id))]
        except Exception as exc:
            log.exception("A2A stream of %s failed", run_id)
            yield [error_response(call, InternalError(message=str(exc) or None))]


def _framed(call: Call, update: pb.StreamResponse, seq: int) -> Identified:
    return Identified(seq, stream_frame(call, update))


def _opening_frame(call: Call, projection: TaskProjection, plain: bool) -> Identified:
    """The stream's opening snapshot (the Task as it stands); with `plain`,
    the common Task written straight from the projection (`plain_task_json`,
    the same JSON as through protobuf)."""
    task = projection.plain_task_json() if plain else None
    if task is not None:
        return Identified(projection.last_seq, stream_result(call, {"task": task}))
    return _framed(call, pb.StreamResponse(task=projection.task()), projection.last_seq)


def _frames(
    call: Call, projection: TaskProjection, burst: list[tuple[int, Any]], plain: bool
) -> list[Identified]:
    """A burst of events as the stream's frames: each event folded into
    `projection`, each update it becomes framed. With `plain`, a text delta's
    update is written straight from the projection (`plain_updates`), the
    same JSON as through protobuf."""
    frames = []
    for seq, event in burst:
        results = projection.plain_updates(seq, event) if plain else None
        if results is not None:
            frames.extend(Identified(seq, stream_result(call, result)) for result in results)
        else:
            frames.extend(_framed(call, update, seq) for update in projection.apply(seq, event))
    return frames


async def _reopened(funduq: Any, run_id: str, after_seq: int, quiet: Quiet | None) -> bool:
    """`Funduq.wait_reopened` within `quiet`'s wait: False if that ended first."""
    if quiet is None:
        await funduq.wait_reopened(run_id, after_seq)
        return True
    with quiet.waiting() as scope:
        await funduq.wait_reopened(run_id, after_seq)
    return not scope.cancelled_caught


#: A SendMessage's inline push config and the room held for it.
InlinePush = tuple[pb.TaskPushNotificationConfig, PushSlot]


def _inline_push(call: Call) -> pb.TaskPushNotificationConfig | None:
    """The push config a SendMessage carries in its configuration, if any."""
    configuration = call.request.configuration
    if not configuration.HasField("task_push_notification_config"):
        return None
    config = configuration.task_push_notification_config
    copy = pb.TaskPushNotificationConfig(id=config.id, url=config.url, token=config.token)
    if config.HasField("authentication"):
        copy.authentication.CopyFrom(config.authentication)
    return copy


def _task_id(call: Call) -> str | None:
    request_obj = call.request
    if request_obj is None:
        return None
    if call.op in (SEND, STREAM):
        return request_obj.message.task_id or None
    return getattr(request_obj, "id", None) or None
