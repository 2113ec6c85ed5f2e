"""Progress bars (rich) for long byte-counted work: writing, loading and hashing checkpoints.

`byte_progress(description, total, enabled)` is a context manager giving `advance(n_bytes)`; disabled, it
does nothing. Bars go to stderr, so that stdout stays the program's output."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn


@contextlib.contextmanager
def byte_progress(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)
