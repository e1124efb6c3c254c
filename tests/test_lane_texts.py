"""A lane keeps the assistant's text for the thread's history
(``Lane._note_text``); its road for the commonest event (a delta of a
message begun, with room for it) keeps exactly what the general one
(``Lane._keep_text``) keeps, the bound on the text's size included."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from funduq_trio.broker.lanes import Lane
from funduq_trio.config import Settings

ROW = {
    "id": "run_1",
    "thread_id": "thread_1",
    "provider_key": "k",
    "agent_name": "a",
    "status": "running",
    "input": "{}",
    "caller_metadata": "{}",
    "metadata": {},
    "next_seq": 1,
}


def _lane(max_body_bytes: int) -> Lane:
    host = SimpleNamespace(settings=Settings(max_body_bytes=max_body_bytes))
    return Lane(host, dict(ROW), arriving=False)  # type: ignore[arg-type]


def _general(lane: Lane, event: dict[str, Any]) -> None:
    """``_note_text`` as it was before its road: every event through ``_keep_text``."""
    kind, mid = event["type"], event.get("messageId")
    if not isinstance(mid, str):
        return
    if kind == "TEXT_MESSAGE_START":
        role = event.get("role", "assistant")
        lane._keep_text(mid, role if isinstance(role, str) else "assistant", "", restart=True)
    elif kind in ("TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CHUNK"):
        delta = event.get("delta")
        lane._keep_text(mid, "assistant", delta if isinstance(delta, str) else "")


# Mostly the shapes that matter (a message begun, then its deltas, the
# room running out), with the odd one the general road refuses.
_events = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(
                ["TEXT_MESSAGE_START"] + ["TEXT_MESSAGE_CONTENT"] * 4 + ["TEXT_MESSAGE_CHUNK", "X"]
            ),
            "messageId": st.sampled_from(["m1", "m1", "m1", "m2", None, 7]),
            "delta": st.one_of(st.text(max_size=9), st.text(max_size=9), st.none(), st.integers()),
        },
        optional={"role": st.one_of(st.sampled_from(["assistant", "tool"]), st.integers())},
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(_events, st.integers(0, 40))
def test_the_commonest_delta_keeps_what_the_general_road_keeps(events, room):
    fast, general = _lane(room), _lane(room)
    for event in events:
        fast._note_text(event)
        _general(general, event)
        assert fast._texts == general._texts
        assert fast._text_room == general._text_room
    assert fast.replies() == general.replies()
