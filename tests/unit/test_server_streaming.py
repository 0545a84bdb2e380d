"""merge_async_iterators: items tagged with their iterator's position, and every input closed at the end."""

from __future__ import annotations

import asyncio

import pytest

from fitserve.server.streaming import merge_async_iterators


class Numbers:
    """An async iterator over a list that records whether it was closed."""

    def __init__(self, values: list[int], delay_s: float = 0.0) -> None:
        self.values = list(values)
        self.delay_s = delay_s
        self.closed = False

    def __aiter__(self) -> Numbers:
        return self

    async def __anext__(self) -> int:
        await asyncio.sleep(self.delay_s)
        if not self.values:
            raise StopAsyncIteration
        return self.values.pop(0)

    async def aclose(self) -> None:
        self.closed = True


async def collect(*iterators: Numbers) -> list[tuple[int, int]]:
    return [item async for item in merge_async_iterators(*iterators)]


@pytest.mark.parametrize("count", [1, 3])
def test_every_item_comes_tagged_and_every_input_is_closed(count: int) -> None:
    inputs = [Numbers([10 * i + j for j in range(4)], delay_s=0.001 * (i + 1)) for i in range(count)]
    items = asyncio.run(collect(*inputs))
    for index in range(count):
        assert [value for tag, value in items if tag == index] == [10 * index + j for j in range(4)]
    assert len(items) == 4 * count
    assert all(numbers.closed for numbers in inputs)


@pytest.mark.parametrize("count", [1, 2])
def test_closing_early_closes_every_input(count: int) -> None:
    inputs = [Numbers(list(range(100)), delay_s=0.001) for _ in range(count)]

    async def take_two() -> list[tuple[int, int]]:
        merged = merge_async_iterators(*inputs)
        taken = [await merged.__anext__(), await merged.__anext__()]
        await merged.aclose()
        return taken

    taken = asyncio.run(take_two())
    assert len(taken) == 2
    assert all(numbers.closed for numbers in inputs)
