"""How a run that reached a provider settles (DESIGN §2, first match wins):
interrupt -> input-required; RUN_FINISHED -> completed; cancel requested ->
cancelled; else failed provider_stream_ended_without_finishing. Plus what is
malformed (fails the run) and what is merely new (relayed untouched)."""

import pytest
import trio
from broker_support import (
    Follower,
    Provider,
    accepted,
    broker,
    events_of,
    interrupt_finish,
    quiet,
    record_of,
    reply,
)

STREAM_ENDED = "provider_stream_ended_without_finishing"
MALFORMED = "provider sent a malformed AG-UI event"

INTERRUPTS = [
    {
        "id": "approve-1",
        "reason": "tool_approval",
        "message": "Wire 30 EUR to Bob?",
        "toolCallId": "call-7",
        "responseSchema": {"type": "object"},
        "expiresAt": "2031-02-03T04:05:06Z",
        "metadata": {"severity": "high"},
    },
    {"id": "pick-2", "reason": "missing_value", "expiresAt": "2031-02-03T05:00:00+01:00"},
]


def run_errors(record):
    return [e for e in events_of(record) if e.get("type") == "RUN_ERROR"]


async def test_interrupt_outcome_pauses_with_interrupts_verbatim(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        events = reply(a.run_id, a.thread_id)[:-1]
        events.append(interrupt_finish(a.run_id, a.thread_id, INTERRUPTS))
        p.stream(a.run_id, *events)
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "input-required"
        assert record["metadata"]["interrupts"] == INTERRUPTS
        assert events_of(record) == events  # no RUN_ERROR, nothing synthesized
        assert (await funduq.paused_run(a.thread_id)) == a.run_id
        assert (await funduq.wait_run(a.run_id))["status"] == "input-required"


async def test_interrupt_outranks_a_requested_cancel(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        await funduq.cancel_run(a.run_id)
        p.stream(a.run_id, interrupt_finish(a.run_id, a.thread_id, INTERRUPTS[1:]))
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "input-required"
        assert record["metadata"]["interrupts"] == INTERRUPTS[1:]


async def test_run_finished_completes(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        p.stream(a.run_id, *reply(a.run_id, a.thread_id))
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "completed"
        assert run_errors(record) == []
        assert "failureReason" not in record["metadata"]


async def test_a_cancelled_run_without_run_finished_is_cancelled_with_no_run_error(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        await funduq.cancel_run(a.run_id)
        p.stream(a.run_id, *reply(a.run_id, a.thread_id)[:2])
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "cancelled"
        assert run_errors(record) == []


async def test_a_stream_ending_without_run_finished_fails_with_a_synthesized_run_error(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        events = reply(a.run_id, a.thread_id)[:-1]
        async with trio.open_nursery() as nursery:
            follower = Follower(funduq, a.run_id)
            nursery.start_soon(follower.run)
            await quiet()
            p.stream(a.run_id, *events)
            await quiet()
            assert follower.ended.is_set()
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "failed"
        assert record["metadata"]["failureReason"] == STREAM_ENDED
        synthesized = {"type": "RUN_ERROR", "message": STREAM_ENDED, "code": STREAM_ENDED}
        assert events_of(record) == [*events, synthesized]
        assert [e["seq"] for e in record["events"]] == list(range(1, len(events) + 2))
        # ...and relayed to the caller following the run.
        assert [e for _, e in follower.items] == [*events, synthesized]


async def test_events_recorded_together_reach_a_follower_as_one_burst(tmp_path, mock_clock):
    """A provider's batch is persisted in one commit and handed to each
    follower as one burst (which a door writes as one chunk)."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        events = reply(a.run_id, a.thread_id)
        async with trio.open_nursery() as nursery:
            follower = Follower(funduq, a.run_id)
            nursery.start_soon(follower.run)
            await quiet()
            p.stream(a.run_id, *events[:3], finish=False)
            await quiet()
            p.stream(a.run_id, *events[3:])
            await quiet()
            assert follower.ended.is_set()
        assert follower.bursts == [[1, 2, 3], list(range(4, len(events) + 1))]


async def test_a_finish_with_no_events_at_all_fails(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        assert p.session.finish(a.run_id)
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "failed"
        assert events_of(record) == [
            {"type": "RUN_ERROR", "message": STREAM_ENDED, "code": STREAM_ENDED}
        ]


async def test_a_run_that_reported_its_own_run_error_gets_no_second_one(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        own = {"type": "RUN_ERROR", "message": "the model melted", "code": "MELTED"}
        p.stream(a.run_id, reply(a.run_id, a.thread_id)[0], own)
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "failed"
        assert record["metadata"]["failureReason"] == STREAM_ENDED
        assert run_errors(record) == [own]


# -- 10. malformed vs merely new ------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(
            {"type": "TEXT_MESSAGE_CONTENT", "delta": "no message id"}, id="known-invalid"
        ),
        pytest.param(
            {"type": "RUN_FINISHED", "outcome": {"type": "interrupt", "interrupts": []}},
            id="known-invalid-finish",
        ),
        pytest.param({"messageId": "m", "delta": "x"}, id="no-type"),
        pytest.param({"type": 7, "delta": "x"}, id="non-string-type"),
        pytest.param(["RUN_STARTED"], id="not-an-object"),
    ],
)
async def test_a_malformed_event_fails_the_run(tmp_path, mock_clock, bad):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        good = reply(a.run_id, a.thread_id)[:2]
        p.stream(a.run_id, *good, finish=False)
        await quiet()
        p.session.report(a.run_id, bad)
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "failed"
        assert record["metadata"]["failureReason"] == MALFORMED
        assert events_of(record) == [
            *good,
            {"type": "RUN_ERROR", "message": MALFORMED, "code": MALFORMED},
        ]
        # The run is over: whatever the provider says next changes nothing.
        p.session.report(a.run_id, reply(a.run_id, a.thread_id)[-1])
        p.session.finish(a.run_id)
        assert await record_of(funduq, a.run_id) == record


async def test_a_malformed_event_in_a_burst_keeps_the_good_ones_before_it(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        events = reply(a.run_id, a.thread_id)
        for event in events[:3]:
            p.session.report(a.run_id, event)
        p.session.report(a.run_id, {"type": "TEXT_MESSAGE_END"})  # no messageId
        for event in events[3:]:
            p.session.report(a.run_id, event)
        p.session.finish(a.run_id)
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "failed"
        assert record["metadata"]["failureReason"] == MALFORMED
        assert events_of(record) == [
            *events[:3],
            {"type": "RUN_ERROR", "message": MALFORMED, "code": MALFORMED},
        ]


async def test_an_event_of_an_unknown_type_is_stored_and_relayed_untouched(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        novel = {
            "type": "HOLOGRAM_PROJECTED",
            "hologram": {"frames": [1, 2.5, None]},
            "note": None,
            "camelCase": True,
            "snake_case": "kept",
        }
        events = reply(a.run_id, a.thread_id)
        events.insert(1, novel)
        async with trio.open_nursery() as nursery:
            follower = Follower(funduq, a.run_id)
            nursery.start_soon(follower.run)
            await quiet()
            p.stream(a.run_id, *events)
            await quiet()
            assert follower.ended.is_set()
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "completed"
        assert events_of(record)[1] == novel
        assert follower.items[1] == (2, novel)
