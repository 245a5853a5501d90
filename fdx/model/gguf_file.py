"""A small, fast GGUF reader: metadata, tokenizer arrays and tensor views.

``gguf.GGUFReader`` builds one numpy view per metadata element and costs
about 2 s on a 49k-token vocabulary; this reader parses the header with
``struct`` in one pass (tens of milliseconds) and memory-maps tensor data
lazily.  Dequantization is delegated to ``gguf.quants.dequantize``.

Invariant: every structural problem (bad magic, truncated header, tensor
running past the end of the file) raises :class:`ModelLoadError` naming the
file and the reason.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import attrs
import numpy as np

from fdx.core.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR_FMT = {
    _UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i",
    _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d",
}
_NP_DTYPE = {
    _UINT8: np.uint8, _INT8: np.int8, _UINT16: np.uint16, _INT16: np.int16, _UINT32: np.uint32,
    _INT32: np.int32, _FLOAT32: np.float32, _BOOL: np.bool_, _UINT64: np.uint64, _INT64: np.int64,
    _FLOAT64: np.float64,
}


@attrs.frozen
class TensorInfo:
    """One tensor: ``shape`` is numpy order (reversed ggml ``ne``)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Parsed header of a GGUF file; tensor data is read on demand."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.isfile(path):
            raise ModelLoadError(f"{path}: file not found")
        try:
            with open(path, "rb") as f:
                data = f.read(64 << 20)  # header fits easily; grown below if needed
                size = os.fstat(f.fileno()).st_size
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None
        self.file_size = size
        if data[:4] != GGUF_MAGIC:
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic {data[:4]!r})")
        try:
            self._parse(data)
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as exc:
            raise ModelLoadError(f"{path}: corrupt GGUF header ({type(exc).__name__}: {exc})") from None

    # ------------------------------------------------------------------
    def _parse(self, data: bytes) -> None:
        pos = 4
        (self.version,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if self.version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {self.version}")
        n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
        pos += 16
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise ValueError(f"implausible counts (tensors={n_tensors}, kv={n_kv})")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _read_str(data, pos)
            (vtype,) = struct.unpack_from("<I", data, pos)
            pos += 4
            value, pos = _read_value(data, pos, vtype)
            self.fields[key] = value
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name, pos = _read_str(data, pos)
            (n_dims,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dims")
            ne = struct.unpack_from(f"<{n_dims}Q", data, pos)
            pos += 8 * n_dims
            ggml_type, rel = struct.unpack_from("<IQ", data, pos)
            pos += 12
            infos.append((name, tuple(int(x) for x in reversed(ne)), int(ggml_type), int(rel)))
        align = int(self.fields.get("general.alignment", 32))
        start = (pos + align - 1) // align * align
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, gt, rel in infos:
            try:
                qt = GGMLQuantizationType(gt)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown ggml type {gt}") from None
            block, tsize = GGML_QUANT_SIZES[qt]
            n = int(np.prod(shape)) if shape else 1
            nbytes = n // block * tsize
            off = start + rel
            if off + nbytes > self.file_size:
                raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
            self.tensors[name] = TensorInfo(name, shape, gt, off, nbytes)

    # ------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.fields:
            raise ModelLoadError(f"{self.path}: missing metadata key {key!r}")
        return self.fields[key]

    def type_name(self, name: str) -> str:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(self.tensors[name].ggml_type).name

    def load(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32, numpy shape ``[out, in]``."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path}: missing tensor {name!r}")
        qt = GGMLQuantizationType(info.ggml_type)
        raw = np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if raw.size != info.nbytes:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is truncated")
        if qt == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(info.shape)
        if qt == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(info.shape).astype(np.float32)
        if qt == GGMLQuantizationType.BF16:
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
        if qt.name not in SUPPORTED_QUANTS:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has unsupported type {qt.name}")
        # byte shape: rows of (n_in / block) * type_size bytes
        rows = raw.reshape(*info.shape[:-1], -1)
        out = dequantize(rows, qt)
        return np.ascontiguousarray(out.reshape(info.shape), dtype=np.float32)


SUPPORTED_QUANTS = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q8_K"})


def _read_str(data: bytes, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, pos)
    pos += 8
    if pos + n > len(data):
        raise ValueError("string runs past the header buffer")
    return data[pos : pos + n].decode("utf-8"), pos + n


def _read_value(data: bytes, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _read_str(data, pos)
    if vtype == _ARRAY:
        itype, count = struct.unpack_from("<IQ", data, pos)
        pos += 12
        if itype == _STRING:
            out: list[str] = []
            unpack = struct.unpack_from
            for _ in range(count):
                (n,) = unpack("<Q", data, pos)
                pos += 8
                out.append(data[pos : pos + n].decode("utf-8", errors="surrogatepass"))
                pos += n
            return out, pos
        if itype in _NP_DTYPE:
            dt = np.dtype(_NP_DTYPE[itype])
            arr = np.frombuffer(data, dtype=dt, count=count, offset=pos)
            return arr.tolist(), pos + dt.itemsize * count
        if itype == _ARRAY:
            vals = []
            for _ in range(count):
                v, pos = _read_value(data, pos, _ARRAY)
                vals.append(v)
            return vals, pos
        raise ValueError(f"unknown array item type {itype}")
    fmt = _SCALAR_FMT.get(vtype)
    if fmt is None:
        raise ValueError(f"unknown value type {vtype}")
    (v,) = struct.unpack_from(fmt, data, pos)
    return v, pos + struct.calcsize(fmt)


def raw_rows(g: GGUFFile, name: str) -> tuple[np.ndarray, int]:
    """Tensor ``name`` as its raw GGUF bytes, one row per output feature:
    ``(uint8 [rows, row_bytes], ggml type id)``."""
    info = g.tensors.get(name)
    if info is None:
        raise ModelLoadError(f"{g.path}: missing tensor {name!r}")
    raw = np.fromfile(g.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    if raw.size != info.nbytes:
        raise ModelLoadError(f"{g.path}: tensor {name!r} is truncated")
    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    return raw.reshape(rows, -1), info.ggml_type
