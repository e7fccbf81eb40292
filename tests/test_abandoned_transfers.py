"""The watcher of given-up transfers counts each one until the engine says it ended.

pending() is what keeps a given-up write's blocks reserved in the tests that
freeze a pool, and what an operator's metric would show: it must not read 0
while the watcher thread is asking the engine about the very entries it counts.
"""
import threading

from tests.support.nodes import eventually
from tiers.stores.remote.staging import Abandoned


def test_an_entry_stays_counted_while_its_state_is_asked():
    asked, answer = threading.Event(), threading.Event()
    states = {7: 0}

    def status(batch: int) -> int:
        asked.set()
        answer.wait(5)  # the engine is slow to answer: the watcher holds the entry meanwhile
        return states[batch]

    released = []
    watcher = Abandoned(status, poll=0.01)
    try:
        watcher.add([7], lambda: released.append(7))
        assert asked.wait(5)
        assert watcher.pending() == 1, "an entry being checked must still count"
        watcher.add([8], lambda: released.append(8))  # added while the watcher is busy: not lost
        states[8] = 0
        assert watcher.pending() == 2
        states[7] = 1  # ended
        answer.set()
        assert eventually(lambda: released == [7], 5)
        assert watcher.pending() == 1 and released == [7]
        states[8] = -1  # failed: also over
        assert eventually(lambda: watcher.pending() == 0 and released == [7, 8], 5)
    finally:
        answer.set()
        watcher.close()
