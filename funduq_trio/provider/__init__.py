"""The provider SDK: serve AG-UI agents to callers through funduq.

    from funduq_trio.provider import Provider, ProviderIdentity, echo

    provider = Provider(ProviderIdentity.load_or_create("provider.key"),
                        "ws://127.0.0.1:8000/ws/provider", max_concurrent_runs=4)
    provider.add_agent(echo, name="echo", description="says it back")
    trio.run(provider.run)

Depends on trio, trio-websocket, pydantic, ag-ui-protocol, cryptography and
the I/O-free `funduq_trio.protocol` modules (frames, the link machine of
`protocol/provider_link.py`) and `funduq_trio.identity` only: never on the
broker or the web app. See docs/provider-link.md for the wire protocol.
"""

from .cli import run_provider_cli
from .echo import echo, last_user_text, make_echo
from .llm import CompletionRequest, Refusal, fake_model, kyok_chat, kyok_client, make_forwarder
from .runtime import (
    Backoff,
    ConnectRejected,
    FunduqKeyMismatch,
    Provider,
    ProviderIdentity,
    QueryFailed,
    RegisterRejected,
    RunContext,
    current_run,
)
from .serialize import serialize_per_thread
from .transport import Connection, Connector, LinkLost, websocket_connector

__all__ = [
    "Backoff",
    "CompletionRequest",
    "ConnectRejected",
    "Connection",
    "Connector",
    "FunduqKeyMismatch",
    "LinkLost",
    "Provider",
    "ProviderIdentity",
    "QueryFailed",
    "Refusal",
    "RegisterRejected",
    "RunContext",
    "current_run",
    "echo",
    "fake_model",
    "kyok_chat",
    "kyok_client",
    "last_user_text",
    "make_echo",
    "make_forwarder",
    "run_provider_cli",
    "serialize_per_thread",
    "websocket_connector",
]
