"""How each broker exception reads at each door: one table keyed by class.

The HTTP doors answer ``{"error": {"status", "code", "message"}}`` with the
row's status and code; the A2A door answers the row's JSON-RPC error. A class
not in the table reads as its nearest ancestor's row (looked up along the
MRO), so a broker error added later answers as its parent does until it gets
a row of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from a2a.utils.errors import (
    A2AError,
    InternalError,
    InvalidParamsError,
    InvalidRequestError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)

from ..broker import errors as e
from ..identity import InvalidActorChain

__all__ = ["DOOR_ANSWERS", "NOT_AUTHORIZED_MESSAGE", "DoorAnswer", "a2a_error", "door_answer"]

NOT_AUTHORIZED_MESSAGE = (
    "Not authorized: this thread is bound, so the request must carry a signature "
    "(params.metadata.cancel for a cancel, params.metadata.resolution for an answer) "
    "by its segment head or the agent's own provider"
)

#: (the exception, the task id the call named) -> the A2A error.
A2AErrorOf = Callable[[Exception, str | None], A2AError]


@dataclass(frozen=True, slots=True)
class DoorAnswer:
    http_status: int
    code: str
    a2a: A2AErrorOf


def _task(task_id: str | None) -> dict[str, str] | None:
    return {"taskId": task_id} if task_id else None


def _says(
    http_status: int, code: str, error: type[A2AError], default: str, reason: str | None = None
) -> DoorAnswer:
    """The common row: the A2A ``error`` carries the exception's own message
    (``default`` when it has none) and, given one, ``reason`` as its data."""

    def a2a(exc: Exception, _: str | None) -> A2AError:
        return error(message=str(exc) or default, data={"reason": reason} if reason else None)

    return DoorAnswer(http_status, code, a2a)


DOOR_ANSWERS: dict[type[Exception], DoorAnswer] = {
    e.AgentNotFound: _says(
        404,
        "agent_not_found",
        InvalidRequestError,
        "No such agent at this endpoint",
        reason="agent_not_found",
    ),
    e.UnknownThread: _says(
        404,
        "thread_not_found",
        InvalidParamsError,
        "contextId names no conversation with this agent",
        reason="unknown_context",
    ),
    e.RunNotFound: DoorAnswer(
        404, "run_not_found", lambda _, task_id: TaskNotFoundError(data=_task(task_id))
    ),
    e.InvalidRunInput: _says(400, "invalid_run_input", InvalidParamsError, "invalid run input"),
    e.InvalidKyokOptIn: _says(
        400,
        "invalid_kyok_opt_in",
        InvalidParamsError,
        "invalid kyok opt-in",
        reason="invalid_kyok_opt_in",
    ),
    e.ThreadQueueFull: _says(
        429,
        "thread_queue_full",
        UnsupportedOperationError,
        "This conversation already holds as many pending messages as it may; send again "
        "once one has been taken up",
        reason="thread_queue_full",
    ),
    # Deliberately the same answer whatever state the run is in.
    e.NotAuthorized: DoorAnswer(
        403,
        "not_authorized",
        lambda _, __: InvalidParamsError(
            message=NOT_AUTHORIZED_MESSAGE, data={"reason": "not_authorized"}
        ),
    ),
    InvalidActorChain: DoorAnswer(
        403,
        "invalid_actor_chain",
        lambda exc, _: InvalidParamsError(
            message=f"Invalid actorChain: {exc}" if str(exc) else "Invalid actorChain",
            data={"reason": "invalid_actor_chain"},
        ),
    ),
    e.RunNotCancellable: DoorAnswer(
        409, "run_not_cancellable", lambda _, task_id: TaskNotCancelableError(data=_task(task_id))
    ),
    e.RunNotPaused: DoorAnswer(
        409,
        "run_not_paused",
        lambda exc, task_id: InvalidParamsError(
            message=f"Task {task_id} is not waiting for input" if task_id else str(exc)
        ),
    ),
    e.RecordUnavailable: _says(
        503,
        "record_unavailable",
        InternalError,
        "funduq cannot record anything right now; retry later",
        reason="record_unavailable",
    ),
    # Another node of the cluster leads the thread, and forwarding the
    # request there failed (docs/cluster.md): "not now".
    e.ThreadLedElsewhere: _says(
        503,
        "thread_led_elsewhere",
        UnsupportedOperationError,
        "Another funduq node leads this conversation right now and cannot be reached; "
        "retry shortly",
        reason="thread_led_elsewhere",
    ),
    # funduq itself is full (docs/limits.md): like a full thread, "not now".
    **{
        cls: DoorAnswer(
            503,
            cls.code,
            lambda exc, _: UnsupportedOperationError(
                message=str(exc) or "funduq holds as many waiting tasks as it may; retry later",
                data={
                    "reason": getattr(exc, "code", "queue_limit_reached"),
                    **{k: str(v) for k, v in (getattr(exc, "details", None) or {}).items()},
                },
            ),
        )
        for cls in (
            e.QueueLimitReached,
            e.QueuedRunsLimit,
            e.AgentQueuedRunsLimit,
            e.QueuedInputLimit,
        )
    },
    # Answered on the provider link (err), never at a door; here for completeness.
    e.TooManyAgents: _says(400, "too_many_agents", InvalidParamsError, "too many agents"),
    e.ProofsBusy: _says(
        503,
        "proofs_busy",
        UnsupportedOperationError,
        "funduq cannot accept another proof right now; retry later",
        reason="proofs_busy",
    ),
    # The answers a2a-sdk's own server gives a refused or unknown push config.
    e.PushRefused: DoorAnswer(
        400,
        "push_config_refused",
        lambda exc, _: InvalidParamsError(message=f"Invalid push notification config: {exc}"),
    ),
    e.PushConfigNotFound: DoorAnswer(
        404,
        "push_config_not_found",
        lambda exc, _: TaskNotFoundError(message="Push notification config not found"),
    ),
    e.FunduqError: _says(400, "bad_request", InternalError, "bad request"),
}

_UNKNOWN = _says(500, "internal_error", InternalError, "internal error")


def door_answer(exc: BaseException) -> DoorAnswer:
    """The row for ``exc``'s class or its nearest ancestor with one."""
    for cls in type(exc).__mro__:
        row = DOOR_ANSWERS.get(cls)
        if row is not None:
            return row
    return _UNKNOWN


def a2a_error(exc: Exception, *, task_id: str | None = None) -> A2AError:
    """The A2A error ``exc`` reads as."""
    answer = door_answer(exc)
    if answer is _UNKNOWN:
        return InternalError(message=str(exc) or type(exc).__name__)
    return answer.a2a(exc, task_id)
