"""Safetensors shards: find them, read their headers, and load tensors memory-mapped.

Only headers are read when a checkpoint is opened. Each header is checked against its file: a shard
whose data ends before the offsets its header promises (a truncated download) is refused at open time,
naming the file. Tensor data is read later through safetensors' `safe_open` (mmap), one handle per shard.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import safe_open

from .errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
# A header larger than this is not a safetensors header (safetensors itself caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000

# safetensors dtype strings. F4 is float4_e2m1fn_x2: two E2M1 codes per byte, and its header shape counts
# FP4 elements, so the last dimension is twice the number of bytes.
DTYPES = MappingProxyType({
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
})
ELEMENT_BITS = MappingProxyType({k: 4 if k == "F4" else torch.empty(0, dtype=v).element_size() * 8
                                 for k, v in DTYPES.items()})


@dataclass(frozen=True)
class StoredTensor:
    key: str
    file: Path
    dtype: str                  # safetensors dtype string
    shape: tuple[int, ...]      # header shape (FP4 elements along the last axis for F4)
    nbytes: int

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """The shape in stored elements of a byte or wider; F4 counts bytes (two codes each)."""
        if self.dtype == "F4":
            return (*self.shape[:-1], self.shape[-1] // 2)
        return self.shape


def read_header(file: Path) -> dict[str, StoredTensor]:
    """Parse and validate one shard's header against its file size. Reads no tensor data."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: not a safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise CheckpointError(f"{file}: header length {n} is impossible for a {size}-byte file "
                                      "(truncated or not a safetensors file)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: header is not valid JSON ({e}); not a safetensors file?") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    out: dict[str, StoredTensor] = {}
    spans = []
    for key, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {key!r} has a malformed header entry {info!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{file}: tensor {key!r} has dtype {dtype!r}, unknown to dsv4")
        numel = 1
        for d in shape:
            numel *= d
        want = numel * ELEMENT_BITS[dtype] // 8
        if dtype == "F4" and (not shape or shape[-1] % 2):
            raise CheckpointError(f"{file}: F4 tensor {key!r} has shape {list(shape)}; its last axis must be even")
        if end - start != want or start < 0:
            raise CheckpointError(f"{file}: tensor {key!r} ({dtype} {list(shape)}) needs {want} bytes but its "
                                  f"data_offsets [{start}, {end}] span {end - start}")
        if end > data_bytes:
            raise CheckpointError(f"{file}: truncated: tensor {key!r} ends at data byte {end} but the file holds "
                                  f"only {data_bytes} data bytes ({size} bytes in all)")
        spans.append((start, end, key))
        out[key] = StoredTensor(key, file, dtype, shape, want)
    spans.sort()
    for (s0, e0, k0), (s1, e1, k1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise CheckpointError(f"{file}: tensors {k0!r} and {k1!r} overlap in the data section")
    return out


def shard_files(path: Path) -> tuple[Path, list[Path], dict[str, str] | None]:
    """(folder, shard files, weight_map or None) of a checkpoint folder or a single .safetensors file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file():
        return path.parent, [path], None
    index = path / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted(path / f for f in set(weight_map.values()))
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: names shard {f.name!r}, which does not exist in {path}")
        stray = sorted(set(path.glob("*.safetensors")) - set(files))
        if stray:
            raise CheckpointError(f"{stray[0]}: a safetensors file the index does not mention; remove it or add "
                                  f"its tensors to {INDEX_NAME} (dsv4 does not guess whether it belongs)")
        return path, files, weight_map
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors file and no {INDEX_NAME}")
    if len(files) > 1:
        raise CheckpointError(f"{path}: {len(files)} safetensors files but no {INDEX_NAME} saying which belong "
                              f"to the model ({', '.join(f.name for f in files[:4])}...)")
    return path, files, None


def scan(path: Path) -> tuple[Path, dict[str, StoredTensor]]:
    """Every stored tensor of a checkpoint, by key, with the index (if any) checked against the headers."""
    folder, files, weight_map = shard_files(path)
    stored: dict[str, StoredTensor] = {}
    for f in files:
        for key, t in read_header(f).items():
            if key in stored:
                raise CheckpointError(f"tensor {key!r} is stored twice: in {stored[key].file} and in {f}")
            stored[key] = t
    if weight_map is not None:
        index = folder / INDEX_NAME
        for key, name in weight_map.items():
            if key not in stored:
                raise CheckpointError(f"{index}: tensor {key!r} should be in {name} but no shard holds it")
            if stored[key].file.name != name:
                raise CheckpointError(f"{index}: tensor {key!r} is listed in {name} but stored in "
                                      f"{stored[key].file.name}")
        extra = sorted(set(stored) - set(weight_map))
        if extra:
            raise CheckpointError(f"{index}: tensor {extra[0]!r} in {stored[extra[0]].file.name} is missing "
                                  f"from the index ({len(extra)} such tensors)")
    return folder, stored


class ShardReader:
    """Memory-mapped tensor reads, one `safe_open` handle per shard, opened on first use."""

    def __init__(self) -> None:
        self._handles: dict[Path, object] = {}

    def _handle(self, file: Path):
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as e:  # safetensors raises its own SafetensorError
                raise CheckpointError(f"{file}: cannot open ({e})") from None
            self._handles[file] = handle
        return handle

    def load(self, t: StoredTensor, index: tuple | None = None) -> torch.Tensor:
        """The tensor (or `t[index]`, read without loading the rest). F4 comes back as uint8 bytes."""
        try:
            handle = self._handle(t.file)
            if t.dtype == "F4":
                # safetensors cannot slice F4 (its header shape counts elements, not bytes): read it whole.
                value = handle.get_tensor(t.key).view(torch.uint8)
                return value if index is None else value[index]
            if index is None:
                return handle.get_tensor(t.key)
            return handle.get_slice(t.key)[index]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{t.file}: cannot read tensor {t.key!r} ({e})") from None

    def close(self) -> None:
        self._handles.clear()
