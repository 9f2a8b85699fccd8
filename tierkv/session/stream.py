"""An answer's text as it is generated (``Session.ask``/``chat``/``complete`` with ``stream=True``), and
what closing it early lets go of."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Generator, Iterator

from tierkv.session.generation import Answer


class Stream:
    """The text pieces of an answer as they are generated; ``answer`` is complete once the stream
    is exhausted. ``close()`` (or leaving it unfinished and dropping it) stops the generation and
    lets go of what it held; an answer its ``cancelled`` stopped is kept for the next turn, read to
    its end, unless its stream is then closed (a server's client that left)."""

    def __init__(self, pieces: Generator[str, None, None], answer: Answer,
                 unstarted: Callable[[], None] | None = None, stopped: Callable[[], None] | None = None) -> None:
        """``unstarted``: what lets go of the answer's state where the stream is closed before its
        first piece (a generator closed unstarted runs none of its body, its cleanup included);
        ``stopped``: where it is closed after its ``cancelled`` stopped it."""
        self._pieces, self.answer, self._unstarted, self._stopped = pieces, answer, unstarted, stopped

    def __iter__(self) -> Iterator[str]:
        return self                     # (closing what iter() gave closes the stream, and lets go of its state)

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        was = inspect.getgeneratorstate(self._pieces)
        self._pieces.close()
        if was == inspect.GEN_CREATED and self._unstarted is not None:
            self._unstarted, let_go = None, self._unstarted
            let_go()
        elif was == inspect.GEN_CLOSED and self.answer.finish_reason == "cancelled" and self._stopped is not None:
            self._stopped, let_go = None, self._stopped
            let_go()

    def __del__(self) -> None:
        """Dropped unstarted: let go of the state (a started one's generator does, as it is collected)."""
        if self._unstarted is not None and inspect.getgeneratorstate(self._pieces) == inspect.GEN_CREATED:
            self.close()
