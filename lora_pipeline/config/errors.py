"""An exception's chain, for telling what caused an error."""
from __future__ import annotations

from collections.abc import Iterator


def chain(exc: BaseException | None) -> Iterator[BaseException]:
    """The exception, then the one it was raised from (__cause__) or while handling (__context__), and so on."""
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__
