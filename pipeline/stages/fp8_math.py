"""The FP8 arithmetic of the streaming conversion (`fp8_stream`): a few vectorized torch ops per chunk
that give the same bits as compressed-tensors' observer + `calculate_qparams` +
`NaiveQuantizationCompressor.compress` sequence on CPU, and `_exact`, the literal transcription of
that sequence, for chunks holding NaN or inf. Pure: tensors in, tensors out.
"""

from __future__ import annotations

import math

import torch

#
# compressed-tensors, for a weight W (rows x cols, dtype D in f16/bf16/f32/f64), on CPU:
#   observer (memoryless_minmax): min, max = amin/amax over each channel (row) or block
#   calculate_qparams: min = min(min, 0); max = max(max, 0); a = max(|min|, |max|)   [dtype D]
#                      scale = a / (bit_range.to(D) / 2), bit_range = 448 - (-448) as a 0-dim
#                      float32 tensor -> 896 -> 448 in D; kept as that exact expression (a
#                      0-dim divisor may take ATen's scalar fast path)
#                      scale = where(scale == 0, eps(D), scale)
#   weight_scale parameter has dtype D (copy_ is exact)
#   NaiveQuantizationCompressor -> _quantize: q = clamp(W / scale, -448, 448)  [dtype D]
#                      .to(float8_e4m3fn) (.to(D).to(fp8) round trip is exact)
#   block: W zero-padded to whole blocks, the same per block; padding does not change
#   max(|min|, |max|) because min/max are clamped at 0 anyway, and padded rows are cut off.
# max(|min(amin,0)|, |max(amax,0)|) == amax(|W|) exactly (abs is exact, max is exact).


def _q_range(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """calculate_range for FP8: 0-dim float32 tensors -448 and 448 on the device."""
    fp8 = torch.finfo(torch.float8_e4m3fn)
    return torch.tensor(fp8.min, device=device), torch.tensor(fp8.max, device=device)


def _scale_from_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """calculate_qparams for symmetric FP8 from max(|min|,|max|), in absmax's dtype."""
    q_min, q_max = _q_range(absmax.device)
    bit_range = q_max - q_min
    scale = absmax / (bit_range.to(absmax.dtype) / 2)
    eps = torch.finfo(absmax.dtype).eps
    return torch.where(scale == 0, torch.tensor(eps, dtype=scale.dtype, device=scale.device), scale)


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0
FP8_MIN = torch.finfo(torch.float8_e4m3fn).min


class Scratch:
    """Per-thread reusable buffers, so steady-state quantization allocates (and page-faults) nothing big."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._bufs.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = self._bufs[key] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(shape)


def _quantize_values(x: torch.Tensor, scale: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
    """_quantize + round_to_quantized_type_args for finite x and scale: clamp(x / scale, -448, 448)
    in x's dtype, then fp8. (Scalar clamp bounds are several times faster than 0-dim tensor ones and give the
    same bits for every non-NaN value; NaN only arises from non-finite weights, see _exact.)"""
    if scratch is None:
        return (x / scale).clamp_(FP8_MIN, FP8_MAX).to(torch.float8_e4m3fn)
    tmp = scratch.get("div", tuple(x.shape), x.dtype)
    torch.div(x, scale, out=tmp)
    tmp.clamp_(FP8_MIN, FP8_MAX)
    out = scratch.get("fp8", tuple(x.shape), torch.float8_e4m3fn)
    out.copy_(tmp)
    return out


def _exact(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Literal transcription of the compressed-tensors / llmcompressor op sequence (observer
    flatten, amin/amax, calculate_qparams, _process_block / _quantize with tensor clamp bounds
    and the fp8 -> dtype -> fp8 round trip). Slower; used for chunks holding NaN or inf, where
    NaN payloads could otherwise differ."""
    q_min, q_max = _q_range(w.device)
    rows, cols = w.shape
    if block is not None:
        wp = torch.nn.functional.pad(w, (0, (-cols) % block[1], 0, (-rows) % block[0]))
        nbr, nbc = wp.shape[0] // block[0], wp.shape[1] // block[1]
        observed = wp.reshape(nbr, block[0], nbc, block[1]).transpose(1, 2).flatten(-2, -1).unsqueeze(0)
    else:
        observed = w.unsqueeze(-2).unsqueeze(0)
    min_vals = torch.amin(observed, dim=(0, -1))
    max_vals = torch.amax(observed, dim=(0, -1))
    min_vals = torch.min(min_vals, torch.zeros_like(min_vals))
    max_vals = torch.max(max_vals, torch.zeros_like(max_vals))
    bit_range = q_max - q_min
    max_val_pos = torch.max(torch.abs(min_vals), torch.abs(max_vals))
    scale = max_val_pos / (bit_range.to(max_val_pos.dtype) / 2)
    eps = torch.finfo(scale.dtype).eps
    scale = torch.where(scale == 0, torch.tensor(eps, dtype=scale.dtype, device=scale.device), scale)

    def quant(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x / s, q_min, q_max).to(torch.float8_e4m3fn).to(x.dtype).to(torch.float8_e4m3fn)

    if block is None:
        return quant(w, scale), scale
    x_blocks = wp.reshape(nbr, block[0], nbc, block[1]).transpose(1, 2)
    q = quant(x_blocks, scale.unsqueeze(-1).unsqueeze(-1)).transpose(1, 2).reshape(wp.shape)
    return q[:rows, :cols].contiguous(), scale


_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _magnitudes(w: torch.Tensor) -> torch.Tensor:
    """|w| as sign-cleared bit patterns in a same-width integer dtype. For non-negative floats
    the integer order is the float order, so their amax viewed back as float is max|w| exactly
    (= calculate_qparams' max(|min(amin, 0)|, |max(amax, 0)|)), and NaN (above inf) surfaces as
    non-finite. Integer reductions vectorize; bf16 amin/amax on CPU are several times slower."""
    ints = w.view(_INT_OF[w.element_size()])
    return ints & torch.iinfo(ints.dtype).max


def quantize_channel(w: torch.Tensor, scratch: Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 of a 2-D weight -> (fp8 weight, scale[rows, 1] in w.dtype).

    With `scratch`, the returned weight may live in a scratch buffer, valid until the next call."""
    absmax = _magnitudes(w).amax(dim=1, keepdim=True).view(w.dtype)
    if not bool(torch.isfinite(absmax).all()):
        return _exact(w, None)
    scale = _scale_from_absmax(absmax)
    return _quantize_values(w, scale, scratch), scale


def quantize_block(
    w: torch.Tensor, block: tuple[int, int], scratch: Scratch | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 of a 2-D weight -> (fp8 weight, scale[ceil(rows/bh), ceil(cols/bw)] in w.dtype).

    With `scratch`, the returned weight may live in a scratch buffer, valid until the next call."""
    rows, cols = w.shape
    bh, bw = block
    pad_r, pad_c = (-rows) % bh, (-cols) % bw
    wp = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r)) if (pad_r or pad_c) else w
    nbr, nbc = wp.shape[0] // bh, wp.shape[1] // bw
    blocks = wp.view(nbr, bh, nbc, bw)
    # max is exact, so the reduction order is free: across each band's rows first (vectorizes
    # along columns), then within each block
    bands = _magnitudes(wp).view(nbr, bh, nbc * bw)
    absmax = bands.amax(dim=1).view(nbr, nbc, bw).amax(dim=2).view(w.dtype)
    if not bool(torch.isfinite(absmax).all()):
        return _exact(w, block)
    scale = _scale_from_absmax(absmax)
    q = _quantize_values(blocks, scale.view(nbr, 1, nbc, 1), scratch).view(nbr * bh, nbc * bw)
    if pad_r or pad_c:
        q = q[:rows, :cols].contiguous()
    return q, scale
