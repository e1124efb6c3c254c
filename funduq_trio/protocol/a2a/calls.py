"""What a parsed A2A call is: its operation, its dialect, its request.

`parsing` makes a `Call` out of a JSON-RPC body or a REST request; `render`
answers it in its dialect; the door acts on its `op`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from a2a.utils import constants

from .structs import plain, struct_dict

V1 = constants.PROTOCOL_VERSION_1_0
V03 = constants.PROTOCOL_VERSION_0_3
#: The HTTP+JSON binding's "dialect": 1.0 shapes, no JSON-RPC envelope.
REST = "rest"

#: Operations the door performs (`parsing.METHODS_V1` names the 1.0 request of each).
SEND, STREAM, GET, CANCEL, SUBSCRIBE, LIST = (
    "send",
    "stream",
    "get",
    "cancel",
    "subscribe",
    "list",
)
PUSH_CREATE, PUSH_GET, PUSH_LIST, PUSH_DELETE = (
    "push-create",
    "push-get",
    "push-list",
    "push-delete",
)
PUSH_OPS = frozenset({PUSH_CREATE, PUSH_GET, PUSH_LIST, PUSH_DELETE})
EXTENDED_CARD = "extended-card"
STREAMING_OPS = frozenset({STREAM, SUBSCRIBE})


@dataclass(frozen=True)
class Call:
    """One parsed JSON-RPC call: what to do, for whom, in which dialect."""

    request_id: str | int | None
    method: str
    op: str
    dialect: str  # V1 ("1.0") or V03 ("0.3"): which method-name set it used
    request: Any  # the 1.0 protobuf request
    params: Mapping[str, Any] = field(default_factory=dict)  # the raw params object

    @property
    def streaming(self) -> bool:
        return self.op in STREAMING_OPS

    def request_metadata(self) -> dict[str, Any] | None:
        """Request-level metadata (`params.metadata`): funduq's keys ride here.

        Read off the JSON as sent (so integers stay integers), falling back to
        the parsed Struct.
        """
        raw = self.params.get("metadata") if isinstance(self.params, Mapping) else None
        if isinstance(raw, Mapping):
            return cast("dict[str, Any]", plain(raw))  # a Mapping reads as a dict
        if self.request is not None and "metadata" in self.request.DESCRIPTOR.fields_by_name:
            return struct_dict(self.request, "metadata")
        return None
