"""GGUF tensors as a weight source: zero-copy views of the file's mapping."""

from __future__ import annotations

import warnings

import torch

from strata import quant
from strata.gguf.reader import GGUFFile
from strata.formats.weights import QTensor


class GGUFSource:
    def __init__(self, file: GGUFFile):
        self.file = file
        self.description = str(file.path)

    def names(self) -> list[str]:
        return list(self.file.tensors)

    def close(self) -> None:
        """Let go of the file's mapping (`GGUFFile.close`)."""
        self.file.close()

    def populate(self) -> bool:
        """The file's pages mapped in now (`GGUFFile.populate`)."""
        return self.file.populate()

    def get(self, name: str) -> QTensor:
        info = self.file.tensors[name]
        quant.get(info.qtype)  # an unsupported type fails here, naming the type
        raw = self.file.raw(name)
        row_bytes = quant.row_bytes(info.qtype, info.shape[-1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = torch.from_numpy(raw)
        return QTensor(data.reshape(*info.shape[:-1], row_bytes), info.qtype, info.shape)

    def info(self, name: str) -> tuple[str, tuple[int, ...], int]:
        t = self.file.tensors[name]
        return t.qtype.name, t.shape, t.n_bytes
