"""The operator's one work queue (operator/workqueue.py): a key is reconciled once however
often it is queued, never by two workers at once, and again when queued while held; each
key's next look comes from one timer heap, the earliest asked for winning."""

from __future__ import annotations

import asyncio

import hangs

from ftjob.operator.workqueue import WorkQueue


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, hangs.FLOOR))


def test_a_key_queued_twice_is_taken_once_in_order():
    async def go():
        q = WorkQueue()
        for key in ["a", "b", "a", "c", "b"]:
            q.add(key)
        taken = [await q.get() for _ in range(len(q))]
        return taken, len(q)

    assert run(go()) == (["a", "b", "c"], 0)


def test_a_key_queued_while_held_waits_for_its_worker_then_comes_again():
    async def go():
        q = WorkQueue()
        q.add("a")
        held = await q.get()
        q.add("a")  # a pod event during the reconcile
        assert len(q) == 0  # no second worker may take it now
        q.done(held)
        return len(q), await q.get()

    assert run(go()) == (1, "a")


def test_a_pool_of_workers_reconciles_each_key_once_and_never_twice_at_once():
    async def go():
        q, running, seen = WorkQueue(), set(), []

        async def worker():
            while True:
                key = await q.get()
                assert key not in running
                running.add(key)
                seen.append(key)
                await asyncio.sleep(0.001)
                running.discard(key)
                q.done(key)

        workers = [asyncio.create_task(worker()) for _ in range(4)]
        for key in [f"job-{i % 50}" for i in range(500)]:
            q.add(key)
        while len(q) or running:
            await asyncio.sleep(0.01)
        for w in workers:
            w.cancel()
        return seen

    seen = run(go())
    assert sorted(seen) == sorted(f"job-{i}" for i in range(50))


def test_requeues_come_from_one_heap_earliest_first_and_a_later_one_does_not_delay():
    async def go():
        q, loop = WorkQueue(), asyncio.get_running_loop()
        began = loop.time()
        q.add_after("slow", 0.3)
        q.add_after("fast", 0.1)
        q.add_after("fast", 5.0)  # a resync asked after a deadline: the deadline holds
        first = await q.get()
        at_first = loop.time() - began
        q.done(first)
        second = await q.get()
        return first, at_first, second, loop.time() - began

    first, at_first, second, at_second = run(go())
    assert (first, second) == ("fast", "slow")
    assert 0.1 <= at_first < 0.3 <= at_second


def test_a_forgotten_key_is_never_requeued_and_clear_forgets_all():
    async def go():
        q = WorkQueue()
        q.add_after("gone", 0.05)
        q.add("gone")
        q.forget("gone")
        q.add("kept")
        q.add_after("paused", 0.05)
        q.add("paused-too")
        q.clear()
        q.add("after")
        await asyncio.sleep(0.2)  # past every requeue asked for
        return [await q.get() for _ in range(len(q))]

    assert run(go()) == ["after"]
