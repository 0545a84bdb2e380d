"""freeze_startup_heap: garbage is collected first, then what is alive leaves the collector's reach."""

from __future__ import annotations

import gc
import weakref

from fitserve.server.api_server import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_cycles_are_collected_and_live_objects_frozen() -> None:
    first, second = Node(), Node()
    first.other, second.other = second, first  # a cycle only the collector can free
    dead = weakref.ref(first)
    del first, second
    alive = [Node()]
    frozen_before = gc.get_freeze_count()
    try:
        freeze_startup_heap()
        assert dead() is None
        assert gc.get_freeze_count() > frozen_before
        assert all(obj is not alive for obj in gc.get_objects())  # in the permanent generation now
    finally:
        gc.unfreeze()
    assert any(obj is alive for obj in gc.get_objects())
