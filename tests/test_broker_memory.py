"""What a waiting run holds on to: a broker holding ten thousand of them holds
ten thousand of each (bench/scale.py measures the whole)."""

import contextvars

import trio
from broker_support import AGENT, Provider, broker, quiet, user_input

#: Stands in for quart's request context variable, which holds the whole request.
CALLER = contextvars.ContextVar("caller")


def all_tasks() -> list[trio.lowlevel.Task]:
    found, todo = [], [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        found.append(task)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return found


async def test_a_waiting_run_does_not_keep_its_callers_context(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=0).attach()

        async def caller(text: str) -> None:
            CALLER.set(f"the request of {text}")
            await funduq.start_run(p.key, AGENT, user_input(text))

        # The first run starts its thread's task; the second joins that thread.
        await caller("first")
        await quiet()
        first = next(iter(funduq.lanes.values()))
        CALLER.set("the request of second")
        await funduq.start_run(p.key, AGENT, user_input("second"), thread_id=first.thread_id)
        CALLER.set(None)
        await quiet()
        assert len(funduq.lanes) == 2
        assert all(lane.status == "queued" for lane in funduq.lanes.values())
        held = [t.name for t in all_tasks() if t.context.get(CALLER, None) is not None]
        assert held == []
