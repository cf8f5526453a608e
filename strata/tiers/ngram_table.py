"""The per-layer n-gram embedding (PLE) table, read row by row from the file, never whole.

Each token of a PLE layer looks up `(ngram_size - 1) * heads_per_ngram` rows of one big table
(Qwen4-Exp's is ~320M rows, ~90 GB). Which rows depends only on the token ids, through the hash in `strata.formats.ngram_hash`.

`NgramTable` reads only those rows, with `os.pread` on its own file descriptors, on a small
thread pool, into an LRU row cache bounded in bytes. `request(rows)` starts the reads and
returns at once; `Pending.result()` waits for them. The model starts the reads of a step at the
top of its forward, so they overlap the layers before the PLE layer; since rows depend only on
the input, a caller may also `request` the prompt's rows, or a sampled token's, earlier.
`stats()` reports rows and bytes read, cache hits, time spent in reads and time a forward
waited for them (what the reads add to a decode step), per token.

Before any row is read the table's geometry is checked against the hash: a table too small for
the head ranges, with the wrong row width, or whose bytes run past the end of its file is
refused, naming the numbers.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from strata import quant
from strata.errors import BadModelFile
from strata.formats.ngram_hash import TABLE, NgramHash


@dataclass(frozen=True)
class Segment:
    path: str
    offset: int  # byte offset of the segment's first row
    rows: int


class Pending:
    """Reads under way for one `request`; `result()` waits and returns the rows."""

    def __init__(self, table: "NgramTable", shape, unique: np.ndarray, inverse: np.ndarray, have: dict, futures):
        self.table, self.shape, self.unique, self.inverse = table, shape, unique, inverse
        self.have, self.futures = have, futures

    def result(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t0 = time.perf_counter()
        for f in self.futures:
            self.have.update(f.result())
        self.table._waited(time.perf_counter() - t0)
        self.table._touch(self.unique[self.inverse].tolist(), self.have)  # LRU order: the order of use
        data = b"".join(self.have[r] for r in self.unique.tolist())
        rows = self.table.decode(data, len(self.unique))
        return rows[torch.from_numpy(self.inverse)].reshape(*self.shape, -1).to(dtype)


class NgramTable:
    """Rows of a (rows, dim) table stored in one or more file segments; see the module docstring."""

    def __init__(self, segments: list[Segment], dim: int, qtype: gguf.GGMLQuantizationType,
                 cache_bytes: int = 32 << 20, workers: int = 4, description: str = "n-gram table"):
        self.segments, self.dim, self.qtype = segments, dim, qtype
        self.row_bytes = quant.row_bytes(qtype, dim)
        self.rows = sum(s.rows for s in segments)
        self.description = description
        self._starts = np.cumsum([0] + [s.rows for s in segments]).tolist()
        self._check_files()
        self._fds = {p: os.open(p, os.O_RDONLY) for p in {s.path for s in segments}}
        for fd in self._fds.values():  # scattered rows: read-ahead would only fetch pages nobody wants
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._inflight: dict = {}  # row -> the future reading it
        self.cache_bytes = cache_bytes
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ngram-read")
        self._workers = workers
        self._lock = threading.Lock()
        self.reset_stats()

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, file, hash_: NgramHash, row_dim: int, name: str = TABLE, **kw) -> "NgramTable":
        """The table tensor of a `GGUFFile`, checked against the hash before any row is read."""
        info = file.tensors.get(name)
        if info is None:
            raise BadModelFile(f"{file.path}: tensor {name!r} is missing",
                               "the file lists PLE layers but has no n-gram table")
        if len(info.shape) != 2 or info.shape[1] != row_dim:
            raise BadModelFile(f"{file.path}: {name} has shape {info.shape}, but its rows must hold "
                               f"{row_dim} values (embedding_length_per_layer_input)",
                               "the metadata and the table disagree; re-convert the model")
        _check_rows(f"{file.path}: {name}", info.shape[0], hash_)
        if info.n_bytes != info.shape[0] * quant.row_bytes(info.qtype, row_dim):
            raise BadModelFile(f"{file.path}: {name} has {info.n_bytes} bytes for {info.shape[0]} rows of "
                               f"{quant.row_bytes(info.qtype, row_dim)}")
        return cls([Segment(str(file.path), info.offset, info.shape[0])], row_dim, info.qtype,
                   description=f"{file.path}:{name}", **kw)

    @classmethod
    def from_safetensors(cls, parts: list[tuple[str, str]], hash_: NgramHash, row_dim: int,
                         expected_rows: int | None = None, **kw) -> "NgramTable":
        """A table sharded over safetensors tensors [(file, name), ...], joined in that order."""
        segments, qtype, headers = [], None, {}
        for path, key in parts:
            if path not in headers:  # a real checkpoint spreads hundreds of shards over a few files
                headers[path] = _safetensors_header(path)
            header, data_start = headers[path]
            e = header[key]
            dtype, shape, (begin, end) = e["dtype"], e["shape"], e["data_offsets"]
            t = _SAFETENSORS_TYPES.get(dtype)
            if t is None:
                raise BadModelFile(f"{path}: {key} is stored as {dtype}", "the n-gram table must be F32, F16 or BF16")
            if qtype not in (None, t) or len(shape) != 2 or shape[1] != row_dim:
                raise BadModelFile(f"{path}: {key} has shape {tuple(shape)} ({dtype}), expected rows of {row_dim} "
                                   "values like the other shards")
            qtype = t
            if end - begin != shape[0] * quant.row_bytes(t, row_dim):
                raise BadModelFile(f"{path}: {key} spans {end - begin} bytes, but {shape[0]} rows of {row_dim} "
                                   f"{dtype} values take {shape[0] * quant.row_bytes(t, row_dim)}")
            segments.append(Segment(path, data_start + begin, shape[0]))
        if not segments:
            raise BadModelFile("the checkpoint has no n-gram embedding table", "download every shard")
        total = sum(s.rows for s in segments)
        where = f"{parts[0][0]}: {parts[0][1].rsplit('.shard_', 1)[0]}"
        if expected_rows is not None and total != expected_rows:
            raise BadModelFile(f"{where}: the n-gram table has {total} rows in {len(parts)} shards, but the config "
                               f"makes it {expected_rows} rows", "a shard is missing or the config is for another "
                               "checkpoint")
        _check_rows(where, total, hash_)
        return cls(segments, row_dim, qtype, description=where, **kw)

    def _check_files(self) -> None:
        for s in self.segments:
            size = os.stat(s.path).st_size
            end = s.offset + s.rows * self.row_bytes
            if end > size:
                raise BadModelFile(f"{s.path}: the n-gram table's {s.rows} rows of {self.row_bytes} bytes end at "
                                   f"byte {end}, but the file has {size} bytes",
                                   "the file was cut short; fetch it again")

    # -- reading -----------------------------------------------------------------------------

    def request(self, rows: torch.Tensor | np.ndarray) -> Pending:
        """Start reading the rows not already cached; returns at once."""
        rows = np.asarray(rows.cpu() if isinstance(rows, torch.Tensor) else rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.rows):
            raise BadModelFile(f"{self.description}: row {int(rows.max())} requested from a table of {self.rows}")
        unique, inverse = np.unique(rows.reshape(-1), return_inverse=True)
        have, missing, futures = {}, [], {}
        with self._lock:
            for r in unique.tolist():
                data = self._cache.get(r)
                if data is not None:
                    have[r] = data
                elif r in self._inflight:  # an earlier request (a prefetch) is reading it already
                    futures[id(self._inflight[r])] = self._inflight[r]
                else:
                    missing.append(r)
            self._stats["requests"] += 1
            self._stats["rows_requested"] += int(rows.size)
            self._stats["unique_rows"] += len(unique)
            self._stats["cache_hits"] += len(have)
            runs = self._runs(missing)
            n_tasks = min(self._workers, len(runs))
            for i in range(n_tasks):
                mine = runs[i::n_tasks]
                future = self._pool.submit(self._read_runs, mine)
                futures[id(future)] = future
                for first, count in mine:
                    for r in range(first, first + count):
                        self._inflight[r] = future
        return Pending(self, rows.shape, unique, inverse, have, list(futures.values()))

    def gather(self, rows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows (any shape of ids) -> (*shape, dim), read now."""
        return self.request(rows).result(dtype)

    def decode(self, data: bytes, n: int) -> torch.Tensor:
        if n == 0:
            return torch.zeros(0, self.dim)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(n, self.row_bytes)
        if self.qtype == gguf.GGMLQuantizationType.F32:
            return raw.view(torch.float32)
        if self.qtype == gguf.GGMLQuantizationType.F16:
            return raw.view(torch.float16).float()
        if self.qtype == gguf.GGMLQuantizationType.BF16:
            return raw.view(torch.bfloat16).float()
        return quant.dequantize(raw, self.qtype, (n, self.dim))

    def _runs(self, rows: list[int]) -> list[tuple[int, int]]:
        """Sorted rows -> (first row, count) runs of neighbours within one segment, one pread each."""
        runs: list[list[int]] = []
        for r in rows:
            if runs and r == runs[-1][0] + runs[-1][1] and self._segment(r) == self._segment(runs[-1][0]):
                runs[-1][1] += 1
            else:
                runs.append([r, 1])
        return [(a, n) for a, n in runs]

    def _segment(self, row: int) -> int:
        return bisect.bisect_right(self._starts, row) - 1

    def _read_runs(self, runs) -> dict[int, bytes]:
        out, n_bytes, t0 = {}, 0, time.perf_counter()
        for first, count in runs:
            seg = self._segment(first)
            s = self.segments[seg]
            offset = s.offset + (first - self._starts[seg]) * self.row_bytes
            size = count * self.row_bytes
            data = os.pread(self._fds[s.path], size, offset)
            if len(data) != size:
                raise BadModelFile(f"{s.path}: short read of the n-gram table at byte {offset}")
            n_bytes += size
            for i in range(count):
                out[first + i] = data[i * self.row_bytes:(i + 1) * self.row_bytes]
        with self._lock:
            self._insert(out)
            for r in out:
                self._inflight.pop(r, None)
            self._stats["rows_read"] += len(out)
            self._stats["bytes_read"] += n_bytes
            self._stats["read_calls"] += len(runs)
            self._stats["read_s"] += time.perf_counter() - t0
        return out

    def _insert(self, rows: dict[int, bytes]) -> None:
        """Cache rows just read (under the lock), evicting the least recently used past the bound."""
        if self.cache_bytes <= 0:
            return
        for r, data in rows.items():
            self._cache[r] = data
        limit = self.cache_bytes // self.row_bytes
        while len(self._cache) > limit:
            self._cache.popitem(last=False)

    def _touch(self, order: list[int], data: dict[int, bytes]) -> None:
        """Mark rows used, the last used last (the LRU order), re-caching any evicted meanwhile."""
        if self.cache_bytes <= 0:
            return
        with self._lock:
            for r in order:
                self._cache[r] = data[r]
                self._cache.move_to_end(r)
            limit = self.cache_bytes // self.row_bytes
            while len(self._cache) > limit:
                self._cache.popitem(last=False)

    def _waited(self, seconds: float) -> None:
        with self._lock:
            self._stats["wait_s"] += seconds

    # -- accounting --------------------------------------------------------------------------

    def count_tokens(self, n: int) -> None:
        with self._lock:
            self._stats["tokens"] += n

    def reset_stats(self) -> None:
        self._stats = dict(requests=0, tokens=0, rows_requested=0, unique_rows=0, cache_hits=0, rows_read=0,
                           bytes_read=0, read_calls=0, read_s=0.0, wait_s=0.0)

    def stats(self) -> dict:
        """Counters since the last `reset_stats()`, with per-token figures."""
        with self._lock:
            s = dict(self._stats)
            cached = len(self._cache)
        tokens = max(s["tokens"], 1)
        s.update(row_bytes=self.row_bytes, table_rows=self.rows, table_bytes=self.rows * self.row_bytes,
                 cached_rows=cached, cache_bytes=cached * self.row_bytes, cache_limit_bytes=self.cache_bytes,
                 bytes_read_per_token=s["bytes_read"] / tokens, rows_read_per_token=s["rows_read"] / tokens,
                 read_s_per_token=s["read_s"] / tokens, wait_s_per_token=s["wait_s"] / tokens)
        return s

    def drop_cache(self, rows: bool = True) -> None:
        """Ask the kernel to drop the table's pages, and forget the cached rows unless `rows=False`
        (for benchmarks: the next reads come from the device)."""
        if rows:
            with self._lock:
                self._cache.clear()
        for s in self.segments:
            fd = self._fds[s.path]
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, s.offset, s.rows * self.row_bytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __del__(self):
        try:
            self._pool.shutdown(wait=False)
            for fd in self._fds.values():
                os.close(fd)
        except Exception:
            pass


def _check_rows(where: str, rows: int, hash_: NgramHash) -> None:
    if rows < hash_.min_rows:
        raise BadModelFile(f"{where} has {rows} rows, but its {hash_.n_heads} hash heads reach row "
                           f"{hash_.min_rows} (offset + vocabulary of the last head)",
                           "the table and the metadata disagree; re-convert the model")


_SAFETENSORS_TYPES = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
                      "BF16": gguf.GGMLQuantizationType.BF16}


def _safetensors_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def open_table(source, hash_: NgramHash, row_dim: int, expected_rows: int | None = None,
               name: str = TABLE, **kw) -> NgramTable:
    """The table of a weight source: a GGUF (`GGUFSource`) or an HF checkpoint (`HFSource`)."""
    if hasattr(source, "file"):
        return NgramTable.from_gguf(source.file, hash_, row_dim, name, **kw)
    if name not in source.names():
        raise BadModelFile(f"{source.description}: the n-gram embedding table is missing",
                           "download every safetensors shard")
    return NgramTable.from_safetensors(source.locate(name), hash_, row_dim, expected_rows, **kw)


__all__ = ["NgramTable", "Pending", "Segment", "open_table"]
