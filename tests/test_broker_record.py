from broker_support import AGENT, Provider, broker, reply, user_input
async def test_lone_surrogate_event_is_recorded(tmp_path, autojump_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        t = await funduq.start_run(p.key, AGENT, user_input("\ud800 hi"))
        oid, run = await p.offer(0)
        p.session.answer(oid, "accepted")
        p.stream(t.run_id, {"type": "CUSTOM", "name": "x", "value": "\udc00"}, *reply(t.run_id, t.thread_id))
        rec = await funduq.wait_run(t.run_id)
        assert rec["status"] == "completed"
        rec = await funduq.get_run(t.run_id)
        assert rec["events"][0]["event"]["value"] == "\udc00"
