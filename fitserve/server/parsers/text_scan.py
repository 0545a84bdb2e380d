"""Helpers for parsers that read generated text a delta at a time."""

from __future__ import annotations


def partial_tag_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`.

    A streaming parser holds that many trailing characters back: the next delta may complete the tag.
    """
    longest = min(len(text), len(tag) - 1)
    for size in range(longest, 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def trailing_run_len(text: str, chars: str) -> int:
    """Number of trailing characters of `text` that all belong to `chars`."""
    return len(text) - len(text.rstrip(chars))


def marker_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a prefix of one of `markers`, whole ones included.

    A parser holds that many characters back while the output may still end there.
    """
    longest = 0
    for marker in markers:
        for size in range(min(len(text), len(marker)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


def drop_end_marker(text: str, markers: tuple[str, ...]) -> str:
    """`text` without the one marker of `markers` it ends with (if any)."""
    for marker in markers:
        if text.endswith(marker):
            return text[: -len(marker)]
    return text
