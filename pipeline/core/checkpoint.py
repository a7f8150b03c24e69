"""Read a safetensors checkpoint's structure without loading its weights.

Headers tell every tensor's dtype, shape and byte range, so a truncated or missing shard is
found in milliseconds, before anyone spends an hour quantizing or a GPU loading it.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from pydantic import BaseModel

from pipeline.core.errors import ArtifactError

INDEX = "model.safetensors.index.json"
DTYPE_BYTES = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
}
EMBEDDING_SUFFIXES = ("embed_tokens", "wte", "word_embeddings")


class TensorInfo(BaseModel):
    name: str
    dtype: str
    shape: list[int]
    shard: str
    nbytes: int


MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def read_raw_header(path: Path) -> tuple[dict, int, int]:
    """A shard's JSON header as stored (with `__metadata__`), the absolute offset of its data
    buffer and the file's size; ArtifactError naming the file when it is missing or damaged."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) < 8:
                raise ArtifactError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER or length > size - 8:
                raise ArtifactError(f"{path}: truncated or not safetensors: header of {length} bytes, file has {size}")
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        raise ArtifactError(f"{path}: missing shard") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ArtifactError(f"{path}: corrupt safetensors header") from None
    except OSError as exc:
        raise ArtifactError(f"{path}: unreadable safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + length, size


def read_header(path: Path) -> dict:
    """The tensors of one shard's header, checked against the file's real length."""
    header, data_start, size = read_raw_header(path)
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if data_start + end > size:
        raise ArtifactError(f"{path}: truncated: tensors need {data_start + end} bytes, file has {size}")
    return header


def shard_names(model_dir: Path) -> list[str]:
    """Shards listed by the index (every one must exist), or the single model.safetensors."""
    index = model_dir / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise ArtifactError(f"{index}: not a safetensors index (no weight_map)") from None
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not names:
        raise ArtifactError(f"{model_dir}: no safetensors weights")
    return names


def tensors(model_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint; raises ArtifactError naming a missing or truncated shard."""
    out: dict[str, TensorInfo] = {}
    for shard in shard_names(model_dir):
        for name, info in read_header(model_dir / shard).items():
            out[name] = TensorInfo(
                name=name,
                dtype=info["dtype"],
                shape=info["shape"],
                shard=shard,
                nbytes=info["data_offsets"][1] - info["data_offsets"][0],
            )
    index = model_dir / INDEX
    if index.exists():
        listed = json.loads(index.read_text())["weight_map"]
        missing = sorted(set(listed) - set(out))
        if missing:
            raise ArtifactError(f"{index}: lists {missing[0]} in {listed[missing[0]]}, which does not hold it")
    return out


def weights_bytes(model_dir: Path) -> int:
    return sum((model_dir / shard).stat().st_size for shard in shard_names(model_dir))


def matches(module: str, patterns: list[str]) -> bool:
    """compressed-tensors' target rule: an exact module name, or `re:` + a regex matched from the start."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern:
            return True
    return False


def is_embedding(module: str) -> bool:
    return module.rsplit(".", 1)[-1] in EMBEDDING_SUFFIXES
