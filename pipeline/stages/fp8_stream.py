"""Streaming FP8 conversion of a safetensors checkpoint, bit-identical to llmcompressor's
`model_free_ptq` for the FP8_DYNAMIC (per-channel) and FP8_BLOCK (128x128) schemes.

`model_free_ptq` loads a whole shard, wraps every weight in a `torch.nn.Linear`, runs the
observer / calibration / compressor machinery on it one module at a time and saves the shard
with `safetensors.torch.save_file`: peak memory is several times the largest shard and it
runs at a few tens of MB/s. Here the output of each shard is planned from the source header
alone (names, dtypes and shapes of every output tensor are known without reading data), the
header is written first, and the data is then streamed a few MiB at a time: tensors that stay
as they are go through `copy_file_range` (no trip through user space), weights are quantized
in row chunks (rows are independent for per-channel scales, 128-row bands for block scales)
and their bytes written at their planned offsets. Memory per worker is one chunk.

What is reused from llmcompressor / compressed-tensors, so it is identical by construction:
the recipe (`validate_config`), the tensor-to-scheme matching (`_match_tensors_to_schemes`,
which only looks at names), the config.json `quantization_config` (`update_config`) and the
index format. What is not: the quantization arithmetic, re-implemented as a few vectorized
torch ops per chunk that give the same bits as the observer + `calculate_qparams` +
`NaiveQuantizationCompressor.compress` sequence on CPU (`fp8_math`: its notes, `quantize_channel`
/ `quantize_block`, and `_exact`, the literal transcription used for chunks holding NaN or inf).
The tests compare the result bit for bit against a real `model_free_ptq` run, and the arithmetic
against llmcompressor's per-module path on edge values.

Parallelism is at tensor level: `max_workers` threads take (shard, tensor) items in shard
order, each with one torch thread (intra-op threads are restored afterwards), so a single-file
checkpoint is parallel too and shards are completed one after another.

Differences from `model_free_ptq`, all on inputs it mishandles:
- FP8_BLOCK on a weight whose column count is not a multiple of the block width: it crashes
  on save (a non-contiguous slice) after writing earlier shards; vLLM's block kernels also
  need that divisibility. Here it is refused up front, naming the tensor.
- an index that does not agree with a shard's header (a listed tensor missing, or a tensor in
  the shard the index does not list, which it would silently drop) is an ArtifactError.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.core.checkpoint import read_raw_header
from pipeline.core.errors import ArtifactError, SpecError, StreamCancelled
from pipeline.core.files import atomic_write
from pipeline.stages.fp8_math import Scratch, quantize_block, quantize_channel

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DEFAULT_INDEX = "model.safetensors.index.json"
PARTIAL_SUFFIX = ".partial"
CHUNK_BYTES = 2 * 1024 * 1024  # source bytes per quantization step: stays in cache, amortizes Python
COPY_BYTES = 64 * 1024 * 1024  # per copy_file_range call

# safetensors dtype name -> torch dtype (only the ones this module may need to view)
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ITEMSIZE: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "C64": 8,
}
# float dtypes whose scale keeps the weight's dtype (compressed-tensors initialize_qparams)
_SCALE_KEEPS_DTYPE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

Progress = Callable[[str, int, int], None]


# ---------------------------------------------------------------- recipe


@dataclass(frozen=True)
class _Recipe:
    """What the arithmetic needs from a scheme's weight QuantizationArgs."""

    strategy: str  # "channel" | "block"
    block: tuple[int, int] | None


def _build_config(scheme: str, ignore: list[str]):
    """The QuantizationConfig model_free_ptq builds for (scheme, ignore), plus our recipe per group."""
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType
    from llmcompressor.entrypoints.model_free.validate import validate_config

    try:
        config = validate_config(None, scheme, list(ignore))
    except (KeyError, ValueError) as exc:
        raise SpecError([f"scheme {scheme!r}: {exc}"]) from exc
    recipes: dict[str, _Recipe] = {}
    for group, sch in config.config_groups.items():
        w = sch.weights
        ok = (
            w is not None
            and w.type == QuantizationType.FLOAT
            and w.num_bits == 8
            and w.symmetric
            and not w.dynamic
            and w.scale_dtype is None
            and w.observer in (None, "memoryless_minmax", "static_minmax", "minmax")
            and w.strategy in (QuantizationStrategy.CHANNEL, QuantizationStrategy.BLOCK)
        )
        if not ok:
            raise SpecError(
                [
                    f"scheme {scheme!r}: fp8_stream supports static symmetric FP8 weights with "
                    "channel or block scales (FP8_DYNAMIC, FP8_BLOCK)"
                ]
            )
        if w.strategy == QuantizationStrategy.BLOCK:
            recipes[group] = _Recipe("block", (int(w.block_structure[0]), int(w.block_structure[1])))
        else:
            recipes[group] = _Recipe("channel", None)
    return config, recipes


# ---------------------------------------------------------------- planning


@dataclass
class _Src:
    """A contiguous run of source bytes that becomes one output tensor (or weight + scale)."""

    name: str  # tensor name after model_free_ptq's fused-expert split
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute file offset
    nbytes: int
    recipe: _Recipe | None = None  # set if quantized
    module: str = ""
    group: str = ""


@dataclass
class _Out:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # absolute offset in the output file, set by the layout


@dataclass
class _ShardPlan:
    rel: str  # path relative to src / out
    src_path: Path
    out_path: Path
    src_size: int
    sources: list[_Src]
    outputs: dict[str, _Out]
    header: bytes = b""
    out_size: int = 0
    weight_map: dict[str, str] = field(default_factory=dict)


def _parse_entries(path: Path, header: dict[str, Any], data_start: int, size: int) -> dict[str, tuple]:
    """name -> (dtype, shape, absolute offset, nbytes), validated against the file size."""
    entries: dict[str, tuple] = {}
    end_max = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{path}: bad header entry for tensor {name!r}") from exc
        if end < begin or begin < 0:
            raise ArtifactError(f"{path}: bad data_offsets for tensor {name!r}")
        if dtype in _ITEMSIZE and math.prod(shape) * _ITEMSIZE[dtype] != end - begin:
            raise ArtifactError(f"{path}: tensor {name!r} is {end - begin} bytes, its dtype and shape say otherwise")
        entries[name] = (dtype, shape, data_start + begin, end - begin)
        end_max = max(end_max, end)
    if data_start + end_max > size:
        raise ArtifactError(f"{path}: truncated: header says {data_start + end_max} bytes, the file has {size}")
    return entries


def _split_fused_experts(path: Path, entries: dict[str, tuple]) -> list[_Src]:
    """model_free_ptq's split_fused_moe_experts on names/shapes: 3-D gate_up_proj / down_proj
    tensors become 2-D per-expert tensors; each is a contiguous byte range of the source."""
    params_to_split = {"gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]}
    out: list[_Src] = []
    for name, (dtype, shape, offset, nbytes) in entries.items():
        keys = [key for key in params_to_split if key in name]
        if len(keys) >= 2:
            raise ArtifactError(f"{path}: tensor {name!r} matches several fused-expert keys {keys}")
        if len(keys) == 1 and len(shape) == 3:
            key = keys[0]
            parts = params_to_split[key]
            n_exp, dim1, dim2 = shape
            if dim1 % len(parts):
                raise ArtifactError(f"{path}: {key} {name!r} shape {list(shape)} has an odd second dimension")
            if dtype not in _ITEMSIZE:
                raise ArtifactError(f"{path}: cannot split fused tensor {name!r} of dtype {dtype}")
            inter = dim1 // len(parts)
            piece = inter * dim2 * _ITEMSIZE[dtype]
            for e in range(n_exp):
                for p, part in enumerate(parts):
                    new = name.replace(key, f"{e}.{part}")
                    if not new.endswith(".weight"):
                        new = f"{new}.weight"
                    out.append(_Src(new, dtype, (inter, dim2), offset + (e * len(parts) + p) * piece, piece))
        else:
            out.append(_Src(name, dtype, shape, offset, nbytes))
    return out


def _plan_shard(
    rel: str, src_path: Path, out_path: Path, index_names: list[str] | None, config, recipes: dict[str, _Recipe]
) -> _ShardPlan:
    from llmcompressor.entrypoints.model_free.converter import _match_tensors_to_schemes

    header, data_start, size = read_raw_header(src_path)
    entries = _parse_entries(src_path, header, data_start, size)
    if index_names is not None:
        missing = sorted(set(index_names) - entries.keys())
        extra = sorted(entries.keys() - set(index_names))
        if missing:
            raise ArtifactError(f"{src_path}: the index lists tensor {missing[0]!r} which this shard does not hold")
        if extra:
            raise ArtifactError(f"{src_path}: holds tensor {extra[0]!r} which the index does not list")
    sources = _split_fused_experts(src_path, entries)
    by_name: dict[str, _Src] = {}
    for s in sources:
        if s.name in by_name:
            raise ArtifactError(f"{src_path}: two tensors named {s.name!r} after splitting fused experts")
        by_name[s.name] = s

    group_of = {id(sch): g for g, sch in config.config_groups.items()}
    outputs: dict[str, _Out] = {}
    quantized: dict[str, tuple[str, str]] = {}
    # model_free_ptq's matcher reads only the names of the tensors it is given
    names: dict[str, Any] = dict.fromkeys(by_name)
    for module_name, name, sch in _match_tensors_to_schemes(names, config):
        quantized[name] = (module_name, group_of[id(sch)])

    def add(o: _Out) -> None:
        if o.name in outputs:
            raise ArtifactError(f"{src_path}: output tensor {o.name!r} would be written twice")
        outputs[o.name] = o

    for s in sources:
        if s.name not in quantized:
            add(_Out(s.name, s.dtype, s.shape, s.nbytes))
            continue
        module_name, group = quantized[s.name]
        recipe = recipes[group]
        dtype = _TORCH_DTYPES.get(s.dtype)
        if len(s.shape) != 2:
            raise ArtifactError(
                f"{src_path}: cannot quantize {s.name!r}: expected a 2-D linear weight, got shape {list(s.shape)}; "
                "add its module to ignore"
            )
        if 0 in s.shape:
            raise ArtifactError(f"{src_path}: cannot quantize the empty tensor {s.name!r}; add its module to ignore")
        if dtype not in _SCALE_KEEPS_DTYPE:
            raise ArtifactError(f"{src_path}: cannot quantize {s.name!r} of dtype {s.dtype}; add its module to ignore")
        rows, cols = s.shape
        if recipe.strategy == "block":
            assert recipe.block is not None  # _build_config gives every block recipe its shape
            bh, bw = recipe.block
            if cols % bw:
                raise ArtifactError(
                    f"{src_path}: cannot block-quantize {s.name!r}: {cols} columns is not a multiple of {bw} "
                    f"(model_free_ptq cannot save it, vLLM's block kernels need whole column blocks); "
                    f"add {module_name!r} to ignore"
                )
            scale_shape = (math.ceil(rows / bh), cols // bw)
        else:
            scale_shape = (rows, 1)
        s.recipe, s.module, s.group = recipe, module_name, group
        weight_name, scale_name = f"{module_name}.weight", f"{module_name}.weight_scale"
        add(_Out(weight_name, "F8_E4M3", s.shape, rows * cols))
        add(_Out(scale_name, s.dtype, scale_shape, math.prod(scale_shape) * _ITEMSIZE[s.dtype]))

    plan = _ShardPlan(rel, src_path, out_path, size, sorted(sources, key=lambda s: s.offset), outputs)
    _layout(plan)
    return plan


def _layout(plan: _ShardPlan) -> None:
    """safetensors layout as save_file does it: largest itemsize first, then by name (aligned)."""
    order = sorted(plan.outputs.values(), key=lambda o: (-_ITEMSIZE.get(o.dtype, 1), o.name))
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for o in order:
        meta[o.name] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": [pos, pos + o.nbytes]}
        o.offset = pos
        pos += o.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    plan.header = struct.pack("<Q", len(raw)) + raw
    for o in order:
        o.offset += len(plan.header)
    plan.out_size = len(plan.header) + pos
    base = os.path.basename(plan.rel)
    plan.weight_map = {o.name: base for o in plan.outputs.values()}


# ---------------------------------------------------------------- execution


def _pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise ArtifactError(f"{path}: truncated: ends before byte {offset + len(buf)}")
        done += n


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)


class _ShardWriter:
    """One output shard: created (header written) on first use, renamed into place by whichever
    worker finishes its last tensor, removed if the conversion fails."""

    def __init__(self, plan: _ShardPlan, progress: Progress | None):
        self.plan = plan
        self.progress = progress
        self.tmp = plan.out_path.with_name(plan.out_path.name + PARTIAL_SUFFIX)
        self.lock = threading.Lock()
        self.src_fd: int | None = None
        self.dst_fd: int | None = None
        self.remaining = len(plan.sources)
        self.done = plan.src_size - sum(s.nbytes for s in plan.sources)  # header bytes
        self.finished = False

    def fds(self) -> tuple[int, int]:
        with self.lock:
            if self.dst_fd is None:
                self.tmp.parent.mkdir(parents=True, exist_ok=True)
                self.src_fd = os.open(self.plan.src_path, os.O_RDONLY)
                self.dst_fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.ftruncate(self.dst_fd, self.plan.out_size)
                _pwrite_all(self.dst_fd, memoryview(self.plan.header), 0)
                self._report()
            assert self.src_fd is not None  # opened with dst_fd, under the same lock
            return self.src_fd, self.dst_fd

    def piece_done(self, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes
            self.remaining -= 1
            self._report()
            if self.remaining <= 0:
                self._close()
                os.replace(self.tmp, self.plan.out_path)
                self.finished = True

    def abort(self) -> None:
        with self.lock:
            self._close()
            if not self.finished:
                self.tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        for fd in (self.src_fd, self.dst_fd):
            if fd is not None:
                os.close(fd)
        self.src_fd = self.dst_fd = None

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self.plan.rel, self.done, self.plan.src_size)


class _Worker:
    """Takes (shard, tensor) items off a shared list until it is empty or the run is stopped."""

    def __init__(self, stop: threading.Event):
        self.stop = stop
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.scratch = Scratch()
        self.quantized = self.copied = 0
        self._copy_file_range = hasattr(os, "copy_file_range")

    def run(self, next_item: Callable[[], tuple[_ShardWriter, _Src | None] | None]) -> None:
        while not self.stop.is_set():
            item = next_item()
            if item is None:
                return
            writer, s = item
            src_fd, dst_fd = writer.fds()
            if s is None:  # a shard without tensors
                writer.piece_done(0)
                continue
            if s.recipe is None:
                self._copy(src_fd, dst_fd, s, writer.plan.outputs[s.name].offset, writer.plan.src_path)
                self.copied += 1
            else:
                self._quantize(src_fd, dst_fd, s, writer.plan)
                self.quantized += 1
            writer.piece_done(s.nbytes)

    def _buffer(self, n: int) -> torch.Tensor:
        if self.buf.numel() < n:
            self.buf = torch.empty(n, dtype=torch.uint8)
        return self.buf[:n]

    def _copy(self, src_fd: int, dst_fd: int, s: _Src, out_offset: int, path: Path) -> None:
        pos = 0
        while pos < s.nbytes:
            if self.stop.is_set():
                raise StreamCancelled()
            n = min(COPY_BYTES, s.nbytes - pos)
            if self._copy_file_range:
                try:
                    got = os.copy_file_range(src_fd, dst_fd, n, s.offset + pos, out_offset + pos)
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                        raise
                    self._copy_file_range = False
                    continue
                if got == 0:
                    raise ArtifactError(f"{path}: truncated: ends inside tensor {s.name!r}")
            else:
                got = min(n, CHUNK_BYTES)
                view = memoryview(self._buffer(got).numpy().data)
                _pread_into(src_fd, view, s.offset + pos, path)
                _pwrite_all(dst_fd, view, out_offset + pos)
            pos += got

    def _quantize(self, src_fd: int, dst_fd: int, s: _Src, plan: _ShardPlan) -> None:
        rows, cols = s.shape
        dtype = _TORCH_DTYPES[s.dtype]
        item = _ITEMSIZE[s.dtype]
        row_bytes = cols * item
        w_out = plan.outputs[f"{s.module}.weight"]
        s_out = plan.outputs[f"{s.module}.weight_scale"]
        assert s.recipe is not None  # only quantized sources come here
        block = s.recipe.block
        # whole rows per chunk (channel scales), whole 128-row bands (block scales)
        unit = block[0] if block else 1
        step = max(1, CHUNK_BYTES // (row_bytes * unit)) * unit
        with torch.inference_mode():
            for r0 in range(0, rows, step):
                if self.stop.is_set():
                    raise StreamCancelled()
                n = min(step, rows - r0)
                raw = self._buffer(n * row_bytes)
                _pread_into(src_fd, memoryview(raw.numpy().data), s.offset + r0 * row_bytes, plan.src_path)
                w = raw.view(dtype).view(n, cols)
                if block:
                    q, scale = quantize_block(w, block, self.scratch)
                    scale_offset = s_out.offset + (r0 // block[0]) * scale.shape[1] * item
                else:
                    q, scale = quantize_channel(w, self.scratch)
                    scale_offset = s_out.offset + r0 * item
                _pwrite_all(dst_fd, _bytes_of(q), w_out.offset + r0 * cols)
                _pwrite_all(dst_fd, _bytes_of(scale), scale_offset)


def _run(plans: list[_ShardPlan], max_workers: int, progress: Progress | None) -> tuple[int, int]:
    """Convert all shards with a pool of max_workers threads sharing the tensors of all shards
    (in shard order, so shards complete one after another). -> (tensors quantized, copied)"""
    writers = [_ShardWriter(plan, progress) for plan in plans]
    no_tensor: list[_Src | None] = [None]  # a shard without tensors still gets its header written
    items = iter([(w, s) for w in writers for s in (w.plan.sources or no_tensor)])
    items_lock = threading.Lock()

    def next_item():
        with items_lock:
            return next(items, None)

    stop = threading.Event()
    workers = [_Worker(stop) for _ in range(max(1, int(max_workers)))]
    errors: list[BaseException] = []

    def work(worker: _Worker) -> None:
        try:
            worker.run(next_item)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors.append(exc)
            stop.set()

    # tensor-level parallelism replaces intra-op parallelism: one torch thread per worker (restored
    # after; intra-op threads on small chunks mostly wait on each other, badly so on a busy machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ok = False
    try:
        with ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix="fp8") as pool:
            futures = [pool.submit(work, worker) for worker in workers]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                stop.set()
                raise
        real = [e for e in errors if not isinstance(e, StreamCancelled)]
        if real or errors:
            raise (real or errors)[0]
        ok = True
    finally:
        torch.set_num_threads(threads)
        if not ok:
            for writer in writers:
                writer.abort()
    return sum(w.quantized for w in workers), sum(w.copied for w in workers)


# ---------------------------------------------------------------- entry point


def _checkpoint_files(src: Path) -> dict[str, Path]:
    """Relative path -> path, like compressed-tensors' get_checkpoint_files for a local dir."""
    files: dict[str, Path] = {}
    for dirpath, _, filenames in os.walk(src):
        for filename in filenames:
            full = Path(dirpath) / filename
            rel = os.path.relpath(full, src)
            if not any(rel.startswith(prefix) for prefix in (".cache", ".gitattributes")):
                files[rel] = full
    return files


def _index_of(files: dict[str, Path]) -> str | None:
    """Source index, as compressed-tensors' find_safetensors_index_file picks it."""
    for suffix in (DEFAULT_INDEX, ".safetensors.index.json"):
        for rel in files:
            if rel.endswith(suffix):
                return rel
    return None


def convert(
    src: Path,
    out: Path,
    scheme: str,
    ignore: list[str],
    max_workers: int = 2,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    """Quantize every safetensors shard of `src` into `out` (out must exist and be empty or only partly written by us).

    Writes each shard under its own name (via `<name>.partial`, renamed when complete), every
    other file of `src` except `manifest.json`, config.json with the `quantization_config`
    model_free_ptq writes, and `model.safetensors.index.json` (or the source index's name).
    `progress(shard, bytes_done, bytes_total)` is called from worker threads as source bytes
    are consumed. Returns figures: bytes_read, bytes_written, seconds, tensors_quantized,
    tensors_copied.
    """
    started = time.monotonic()
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise ArtifactError(f"{src}: source checkpoint directory does not exist")
    if not out.is_dir():
        raise ArtifactError(f"{out}: output directory does not exist")
    if out.resolve() == src.resolve():
        raise ArtifactError(f"{out}: the output directory is the source directory")
    config, recipes = _build_config(scheme, ignore)

    files = _checkpoint_files(src)
    shards = sorted(rel for rel in files if rel.endswith("safetensors"))
    if not shards:
        raise ArtifactError(f"{src}: no .safetensors files")
    index_rel = _index_of(files)
    index_names: dict[str, list[str]] | None = None
    if index_rel is not None:
        try:
            weight_map = json.loads(files[index_rel].read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ArtifactError(f"{files[index_rel]}: unreadable safetensors index: {exc}") from exc
        index_names = {}
        for name, shard in weight_map.items():
            index_names.setdefault(shard, []).append(name)
        for shard in shards:
            if shard not in index_names:
                raise ArtifactError(f"{src / shard}: not listed in {index_rel}")
        for shard in index_names:
            if shard not in files:
                raise ArtifactError(f"{files[index_rel]}: lists shard {shard} which does not exist")
    elif shards != ["model.safetensors"]:
        raise ArtifactError(f"{src}: several .safetensors files but no model.safetensors.index.json")
    # the index model_free_ptq ends up writing: the copied source index if it sits at the top, else the default
    out_index = (
        index_rel
        if index_rel is not None and "/" not in index_rel and index_rel.endswith("safetensors.index.json")
        else DEFAULT_INDEX
    )
    aux = [rel for rel in files if not rel.endswith("safetensors") and rel != MANIFEST and rel != out_index]

    _check_out(out, set(shards) | set(aux) | {out_index})

    plans = [
        _plan_shard(rel, files[rel], out / rel, None if index_names is None else index_names[rel], config, recipes)
        for rel in shards
    ]

    for rel in aux:  # like model_free_ptq: copy everything else first (it also copies the index)
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(files[rel], out / rel)

    quantized, copied = _run(plans, max_workers, progress)
    written = sum(plan.out_size for plan in plans)

    # config.json exactly as model_free_ptq writes it: compress_module stamps each scheme that
    # compressed at least one module with its format, then update_config merges and dumps
    _stamp_formats(config, plans)
    from llmcompressor.entrypoints.model_free.save_utils import update_config

    update_config(out, config)
    out_map: dict[str, str] = {}
    total_size = 0
    for plan in plans:
        out_map.update(plan.weight_map)
        total_size += sum(o.nbytes for o in plan.outputs.values())
    _write_index(out / out_index, total_size, out_map)

    figures = {
        "bytes_read": sum(p.src_size for p in plans),
        "bytes_written": written,
        "seconds": round(time.monotonic() - started, 3),
        "tensors_quantized": quantized,
        "tensors_copied": copied,
    }
    log.info("fp8_stream %s: %s -> %s, %d shards: %s", scheme, src, out, len(plans), figures)
    return figures


def _check_out(out: Path, ours: set[str]) -> None:
    for dirpath, _, filenames in os.walk(out):
        for filename in filenames:
            rel = os.path.relpath(Path(dirpath) / filename, out)
            if rel in ours or (rel.endswith(PARTIAL_SUFFIX) and rel[: -len(PARTIAL_SUFFIX)] in ours):
                continue
            raise ArtifactError(f"{out / rel}: output directory holds a file this conversion would not write")


def _stamp_formats(config, plans: list[_ShardPlan]) -> None:
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat

    used = {s.group for p in plans for s in p.sources if s.recipe is not None}
    for group, sch in config.config_groups.items():
        if group in used:
            sch.format = CompressionFormat(sch.format or infer_module_format(torch.nn.Linear, sch))


def _write_index(path: Path, total_size: int, weight_map: dict[str, str]) -> None:
    """compressed-tensors' update_safetensors_index, written atomically."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    atomic_write(path, json.dumps(index, indent=2, sort_keys=True))
