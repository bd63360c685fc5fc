"""Validation of token-weight inputs, shared by every trie implementation.

A weight vector has one real entry per vocabulary item (``ws[i]`` for
``decode[i]``): a tensor (on any device), a numpy array or a sequence of
numbers. A batch is a 2-D array/tensor ``[B, V]`` or a sequence of vectors.
Integer and bool weights are converted to floating point; complex, object and
string data are rejected, as is NaN (every reduction of it is undefined).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

Weights = np.ndarray | torch.Tensor


def weights_to_numpy(ws, num_tokens: int, *, batched: bool) -> np.ndarray:
    """``ws`` as a float64 numpy array: ``[V]``, or ``[B, V]`` when ``batched``.

    Raises:
        TypeError: not an array, tensor or sequence of numbers, or a non-real dtype.
        ValueError: wrong number of dimensions, wrong length, or a NaN entry.
    """
    if batched and _is_sequence_of_vectors(ws):
        ws = np.stack([weights_to_numpy(row, num_tokens, batched=False) for row in ws])
    if isinstance(ws, torch.Tensor):
        _check_tensor(ws)
        ws = ws.detach().to(device="cpu", dtype=torch.float64).numpy()
    else:
        ws = _as_real_array(ws)
    _check_shape(tuple(ws.shape), num_tokens, batched)
    ws = np.asarray(ws, dtype=np.float64)
    if np.isnan(ws).any():
        raise ValueError(_nan_message(np.argwhere(np.isnan(ws))[0]))
    return ws


def weights_to_tensor(ws, num_tokens: int, *, batched: bool, device: torch.device) -> torch.Tensor:
    """``ws`` as a float32 tensor on ``device``: ``[V]``, or ``[B, V]`` when ``batched``.

    Tensors on another device are copied to ``device``.

    Raises:
        TypeError: not an array, tensor or sequence of numbers, or a non-real dtype.
        ValueError: wrong number of dimensions, wrong length, or a NaN entry.
    """
    if batched and _is_sequence_of_vectors(ws):
        ws = torch.stack(
            [weights_to_tensor(row, num_tokens, batched=False, device=device) for row in ws]
        )
    if not isinstance(ws, torch.Tensor):
        ws = torch.from_numpy(_as_real_array(ws))
    _check_tensor(ws)
    _check_shape(tuple(ws.shape), num_tokens, batched)
    ws = ws.detach().to(device=device, dtype=torch.float32)
    if torch.isnan(ws).any():
        raise ValueError(_nan_message(torch.nonzero(torch.isnan(ws))[0].tolist()))
    return ws


def _as_real_array(ws) -> np.ndarray:
    """A numpy array of a real dtype from an array or a (nested) sequence of numbers."""
    if isinstance(ws, np.ndarray):
        array = ws
    elif isinstance(ws, Sequence) and not isinstance(ws, str | bytes):
        try:
            array = np.asarray(ws)
        except ValueError as exc:  # ragged rows
            raise ValueError(f"weights must be a rectangular array of numbers: {exc}") from None
    else:
        raise TypeError(
            f"weights must be a torch tensor, numpy array or sequence of numbers, "
            f"got {type(ws).__name__}"
        )
    if array.dtype.kind not in "fiub":
        raise TypeError(f"weights must be real numbers, got dtype {array.dtype}")
    return array


def _is_sequence_of_vectors(ws) -> bool:
    """A list/tuple of tensors or arrays (stacked row by row)."""
    if not isinstance(ws, Sequence) or isinstance(ws, str | bytes):
        return False
    if len(ws) == 0:
        raise ValueError("the batch of weights is empty")
    return isinstance(ws[0], torch.Tensor | np.ndarray)


def _check_tensor(ws: torch.Tensor) -> None:
    if ws.device.type == "meta":
        raise ValueError("weights are on the meta device, which holds no values")
    _check_torch_dtype(ws.dtype)


def _check_torch_dtype(dtype: torch.dtype) -> None:
    if dtype.is_complex:
        raise TypeError(f"weights must be real numbers, got dtype {dtype}")


def _check_shape(shape: tuple[int, ...], num_tokens: int, batched: bool) -> None:
    expected = "[B, V]" if batched else "[V]"
    if len(shape) != (2 if batched else 1):
        raise ValueError(
            f"weights must have shape {expected} with V = {num_tokens}, got shape {shape}"
        )
    if shape[-1] != num_tokens:
        raise ValueError(
            f"weights have {shape[-1]} entries per row, but the vocabulary has {num_tokens} tokens"
        )


def _nan_message(position) -> str:
    where = ", ".join(str(int(i)) for i in position)
    return f"weights contain NaN (first at index [{where}]); trie reductions are undefined for NaN"
