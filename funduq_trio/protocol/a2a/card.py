"""The agent's A2A card, its canonical form and its signature, I/O-free."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from a2a.server.request_handlers.response_helpers import agent_card_to_dict
from a2a.types import a2a_pb2 as pb
from a2a.utils import constants
from a2a.utils.proto_utils import parse_lenient
from google.protobuf.json_format import MessageToDict

from ... import jose
from ...identity import Identity
from .calls import V03, V1


def agent_card(
    *,
    name: str,
    description: str,
    rpc_url: str,
    published: Mapping[str, Any] | None = None,
    rest_url: str | None = None,
    identity: Identity | None = None,
) -> dict[str, Any]:
    """The agent's A2A card as served at `.well-known/agent-card.json`.

    Built as the SDK's `AgentCard` and rendered by the SDK's own
    `agent_card_to_dict` (the 1.0 card plus the 0.3 fields older clients read).
    It offers one JSON-RPC URL under both protocol versions (and, given
    `rest_url`, the HTTP+JSON binding under 1.0), streaming, push
    notifications, and the skills (and version, provider, modes, links) of the
    card the provider published for the agent. Given funduq's `identity`, the
    card is signed (`signatures`: see `sign_card`).
    """
    published = dict(published or {})
    card = pb.AgentCard(
        name=name,
        description=description or str(published.get("description") or "") or name,
        version=str(published.get("version") or "0.0.0"),
        capabilities=pb.AgentCapabilities(
            streaming=True, push_notifications=True, extended_agent_card=False
        ),
    )
    for version in (V1, V03):
        card.supported_interfaces.append(
            pb.AgentInterface(
                url=rpc_url,
                protocol_binding=constants.TransportProtocol.JSONRPC.value,
                protocol_version=version,
            )
        )
    if rest_url is not None:
        card.supported_interfaces.append(
            pb.AgentInterface(
                url=rest_url,
                protocol_binding=constants.TransportProtocol.HTTP_JSON.value,
                protocol_version=V1,
            )
        )
    for key, target in (
        ("defaultInputModes", card.default_input_modes),
        ("defaultOutputModes", card.default_output_modes),
    ):
        modes = published.get(key)
        if not (isinstance(modes, list) and all(isinstance(m, str) for m in modes) and modes):
            modes = ["text/plain", "application/json"]
        target.extend(modes)
    provider = published.get("provider")
    if isinstance(provider, Mapping):
        card.provider.CopyFrom(parse_lenient(dict(provider), pb.AgentProvider()))
    for key, attr in (("documentationUrl", "documentation_url"), ("iconUrl", "icon_url")):
        if isinstance(published.get(key), str) and published[key]:
            setattr(card, attr, published[key])
    for index, skill in enumerate(published.get("skills") or ()):
        parsed = _skill(skill, index)
        if parsed is not None:
            card.skills.append(parsed)
    if not card.skills:
        # A card needs at least one skill; an agent that published none is
        # offered as the one skill it is.
        card.skills.append(
            pb.AgentSkill(id=name, name=name, description=card.description, tags=[name])
        )
    if identity is not None:
        try:
            sign_card(card, identity)
        except ValueError:  # no canonical form (a published number JCS cannot spell)
            del card.signatures[:]
    return agent_card_to_dict(card)


def _without_empty(value: Any) -> Any:
    """The card's JSON with empty strings, lists and objects dropped, as A2A's
    canonical card form (and the SDK's verifier) has it; None when empty."""
    if isinstance(value, dict):
        kept = {k: c for k, v in value.items() if (c := _without_empty(v)) is not None}
        return kept or None
    if isinstance(value, list):
        items = [c for v in value if (c := _without_empty(v)) is not None]
        return items or None
    if isinstance(value, str) and not value:
        return None
    return value


def canonical_card(card: pb.AgentCard) -> bytes:
    """The bytes a card signature covers: the card's ProtoJSON without
    `signatures` and without empty values, in JCS (RFC 8785) form."""
    rendered = MessageToDict(card)
    rendered.pop("signatures", None)
    return jose.canonical_json(_without_empty(rendered) or {})


def sign_card(card: pb.AgentCard, identity: Identity) -> None:
    """Replace the card's `signatures` with one by funduq's identity: a JWS
    over `canonical_card` with the payload detached (protected header
    `{"alg": "EdDSA", "kid": <fingerprint>, "typ": "JOSE"}`; the key is at
    `/.well-known/jwks.json`)."""
    del card.signatures[:]
    protected, signature = jose.detached_jws(identity, canonical_card(card))
    card.signatures.append(pb.AgentCardSignature(protected=protected, signature=signature))


def _skill(raw: Any, index: int) -> pb.AgentSkill | None:
    if not isinstance(raw, Mapping):
        return None
    try:
        skill = parse_lenient(
            {k: v for k, v in raw.items() if k not in ("security", "securityRequirements")},
            pb.AgentSkill(),
        )
    except Exception:  # noqa: BLE001 - a skill that does not parse is left out
        return None
    # The fields a card's skill must have, filled from what it has.
    skill.id = skill.id or skill.name or f"skill-{index}"
    skill.name = skill.name or skill.id
    skill.description = skill.description or skill.name
    if not skill.tags:
        skill.tags.append(skill.id)
    return skill
