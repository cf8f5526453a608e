"""Progress bars on stderr while a model loads (rich), shown only on a terminal: tensors built,
and bytes of experts read into RAM (the load's I/O)."""

from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def tensor_bar(total: int, enabled: bool, what: str = "loading"):
    """Yields `advance()`; a no-op when disabled or when stderr is not a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(what), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)


@contextmanager
def byte_bar(total: int, enabled: bool, what: str = "reading experts into RAM"):
    """Yields `advance(n_bytes)`, with bytes, rate and elapsed time; a no-op when disabled, when
    there is nothing to read, or when stderr is not a terminal."""
    if not enabled or total <= 0 or not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

    columns = (TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)
