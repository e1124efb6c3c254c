from broker_support import AGENT, Provider, broker, reply, user_input


async def test_events_flow_and_run_completes(tmp_path, autojump_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        ticket = await funduq.start_run(p.key, AGENT, user_input())
        offer_id, run = await p.offer(0)
        assert run["runId"] == ticket.run_id and offer_id != ticket.run_id
        p.session.answer(offer_id, "accepted")
        p.stream(ticket.run_id, *reply(ticket.run_id, ticket.thread_id, deltas=3))
        record = await funduq.wait_run(ticket.run_id)
        assert record["status"] == "completed"
        assert [e["seq"] for e in record["events"]] == list(range(1, 8))
