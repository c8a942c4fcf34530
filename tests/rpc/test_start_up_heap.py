"""freeze_start_up_heap: start-up's garbage is collected, what is left goes out of the collector's way."""

import gc
import weakref

from specsplit.rpc.server import freeze_start_up_heap


class Node:
    pass


def test_start_up_garbage_is_collected_and_the_rest_frozen():
    cycle = Node()
    cycle.me = cycle
    dead = weakref.ref(cycle)
    del cycle
    kept = Node()
    gc.disable()  # no collection but the helper's own
    try:
        freeze_start_up_heap()
        assert dead() is None  # a start-up cycle is not frozen into the permanent generation
        assert gc.get_freeze_count() > 0 and not any(o is kept for o in gc.get_objects())
    finally:
        gc.unfreeze()
        gc.enable()
