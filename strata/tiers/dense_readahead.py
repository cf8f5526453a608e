"""Dense weights read ahead from a cold file while the first forward runs.

The dense weights (projections, norms, hyper-connection mixers, the output head) are used from the
read-only mapping as they are. On a cold file every first touch is a page fault that reads a
small window and waits: the full-size qwen4exp's 8-token prefill spent 9 of its 18 s wall in its
DeltaNet and mixer halves with 2.4 s of CPU. A background thread asks the kernel to read them
ahead instead (`posix_fadvise(WILLNEED)`, nothing copied and no anonymous memory: page cache, as
the mapping's own pages are), in the order the forward uses them, block by block, the output head
last. The kernel's request queue paces the thread at disk speed; the expert reads share the disk
with it, as they would with the faults. Stacked experts (their homes read them), the token
embedding and tables read row by row are left out.
"""

from __future__ import annotations

import os
import re
import threading

CHUNK = 8 * 2**20  # bytes per request: large enough for full-speed reads, small enough to stop soon
MERGE_GAP = 2**20  # spans closer than this are read as one
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def dense_spans(tensors, names) -> list[tuple[int, int]]:
    """(offset, bytes) runs of the tensors `names` (from `tensors`, name -> info with offset and
    n_bytes), in the order a forward uses them: by block, then by file offset; tensors of no
    block (the output mixer and head) last. Neighbouring spans are merged."""
    def use_order(name):
        m = _BLOCK.match(name)
        return (int(m.group(1)) if m else 1 << 30, tensors[name].offset)
    runs: list[list[int]] = []
    for name in sorted(names, key=use_order):
        info = tensors[name]
        if info.n_bytes <= 0:
            continue
        start, end = info.offset, info.offset + info.n_bytes
        last = runs[-1] if runs else None
        if last is not None and 0 <= start - last[1] <= MERGE_GAP:
            last[1] = max(last[1], end)
        else:
            runs.append([start, end])
    return [(s, e - s) for s, e in runs]


class DenseReadahead:
    """Reads `spans` of `path` into the page cache on a daemon thread; `close()` stops it."""

    def __init__(self, path, spans: list[tuple[int, int]]):
        self.spans = spans
        self.requested = 0  # bytes asked for so far
        self._stop = threading.Event()
        self._thread = None
        if spans and hasattr(os, "posix_fadvise"):
            self._fd = os.open(path, os.O_RDONLY)
            self._thread = threading.Thread(target=self._run, name="strata-dense-readahead", daemon=True)
            self._thread.start()

    @property
    def total(self) -> int:
        return sum(n for _, n in self.spans)

    def _run(self) -> None:
        try:
            for offset, n in self.spans:
                for start in range(offset, offset + n, CHUNK):
                    if self._stop.is_set():
                        return
                    size = min(CHUNK, offset + n - start)
                    os.posix_fadvise(self._fd, start, size, os.POSIX_FADV_WILLNEED)
                    self.requested += size
        except OSError:
            pass  # a hint only: the faults read what it did not
        finally:
            os.close(self._fd)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
