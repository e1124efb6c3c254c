"""The A2A mapping, I/O-free: JSON-RPC and REST calls in, run records and
AG-UI events out as A2A Tasks and stream updates (DESIGN §5 "A2A door").

Every shape here is built with a2a-sdk's own types -- its protobuf messages
(`a2a.types`) and `google.protobuf.json_format` for protocol 1.0, its v0.3
pydantic models and converters (`a2a.compat.v0_3`) for the 0.3 method names --
and every error is one of its error classes with the code and `error.data` its
own JSON-RPC server gives them. Nothing in this package touches a socket, the
clock or trio; `funduq_trio/web/a2a_door.py` (and `a2a_rest.py`) is the thin
shell that does.

One module per job, in the order a request meets them:

- `parsing`: a body (or a REST request) into a `Call`, or `CallRejected`;
  `calls` is what a `Call` is (operations, dialects).
- `messages`: an A2A Message as the AG-UI `RunAgentInput` it asks for.
- `projection`: run records and AG-UI events as Tasks and stream updates, and
  the run status -> TaskState table; `listing`: ListTasks pages.
- `render`: results, stream frames and errors in the dialect of the call.
- `card`: the agent card, its canonical form and signature.
- `structs`: JSON in and out of protobuf Structs, degrading what cannot fit.

The names below are re-exported so `from funduq_trio.protocol import a2a;
a2a.parse_call(...)` reads as before; new code imports from the module that
does the job.
"""

from .calls import (
    CANCEL,
    EXTENDED_CARD,
    GET,
    LIST,
    PUSH_CREATE,
    PUSH_DELETE,
    PUSH_GET,
    PUSH_LIST,
    PUSH_OPS,
    REST,
    SEND,
    STREAM,
    STREAMING_OPS,
    SUBSCRIBE,
    V03,
    V1,
    Call,
)
from .card import agent_card, canonical_card, sign_card
from .listing import TaskPage, list_tasks_response, select_page
from .messages import message_data, message_text, run_input_from_message
from .parsing import METHODS_V03, METHODS_V1, CallRejected, check_version, parse_call, rest_call
from .projection import (
    AGUI_EVENT_KEY,
    ARTIFACT_EVENT_NAME,
    CANCEL_REQUESTED_KEY,
    TaskProjection,
    status_of_state,
    task_from_record,
    task_state,
)
from .render import error_response, result_response, stream_frame, stream_snapshot
from .structs import DEGRADED_KEY, STRUCT_NESTING, TOO_DEEP, plain

__all__ = [
    "AGUI_EVENT_KEY",
    "ARTIFACT_EVENT_NAME",
    "CANCEL",
    "CANCEL_REQUESTED_KEY",
    "DEGRADED_KEY",
    "EXTENDED_CARD",
    "GET",
    "LIST",
    "METHODS_V03",
    "METHODS_V1",
    "PUSH_CREATE",
    "PUSH_DELETE",
    "PUSH_GET",
    "PUSH_LIST",
    "PUSH_OPS",
    "REST",
    "SEND",
    "STREAM",
    "STREAMING_OPS",
    "STRUCT_NESTING",
    "SUBSCRIBE",
    "TOO_DEEP",
    "V03",
    "V1",
    "Call",
    "CallRejected",
    "TaskPage",
    "TaskProjection",
    "agent_card",
    "canonical_card",
    "check_version",
    "error_response",
    "list_tasks_response",
    "message_data",
    "message_text",
    "parse_call",
    "plain",
    "result_response",
    "rest_call",
    "run_input_from_message",
    "select_page",
    "sign_card",
    "status_of_state",
    "stream_frame",
    "stream_snapshot",
    "task_from_record",
    "task_state",
]
