"""cancel_and_wait ends a task that swallowed its cancel, and gives up on one that never ends."""

import asyncio
import gc

from llmgw.shared.tasks import cancel_and_wait


def run(coro):
    return asyncio.run(coro)


async def swallowing_reader(queue: asyncio.Queue, seen: list) -> None:
    """A reader whose read completes in the same turn as its first cancel, as wait_for
    on Python 3.11 lets happen: the loop goes on as if never cancelled."""
    first = True
    while True:
        try:
            seen.append(await queue.get())
        except asyncio.CancelledError:
            if not first:
                raise
            first = False  # the cancel is lost once, as 3.11's wait_for loses it


def test_one_cancel_is_not_enough_for_a_task_that_swallows_it_but_cancel_and_wait_is():
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        seen: list = []
        task = asyncio.create_task(swallowing_reader(queue, seen))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0.01)
        alive_after_one_cancel = not task.done()
        stuck = await cancel_and_wait([task], timeout=5)
        return alive_after_one_cancel, task, stuck

    alive_after_one_cancel, task, stuck = run(main())
    assert alive_after_one_cancel  # the shape of the hang: a single cancel and a gather would wait for ever
    assert stuck == set() and task.cancelled()


def test_a_task_that_never_ends_is_returned_at_the_deadline():
    async def stubborn(release: asyncio.Event):
        while not release.is_set():
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                pass

    async def main():
        release = asyncio.Event()
        task = asyncio.create_task(stubborn(release))
        await asyncio.sleep(0)
        stuck = await cancel_and_wait([task, None], timeout=0.3)
        release.set()
        await asyncio.wait([task], timeout=5)
        return task, stuck

    task, stuck = run(main())
    assert stuck == {task}


def test_done_and_failed_tasks_are_fine_and_their_exceptions_retrieved():
    async def fails():
        raise ValueError("on its way out")

    async def main():
        unretrieved: list = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx["message"]))
        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        assert task.done()
        stuck = await cancel_and_wait([task])
        failed = task.done() and not task.cancelled()  # not task.exception(): that would retrieve it here
        del task
        gc.collect()  # an unretrieved exception is reported when its task is collected
        return stuck, failed, unretrieved

    stuck, failed, unretrieved = run(main())
    assert stuck == set()
    assert failed
    assert unretrieved == []
