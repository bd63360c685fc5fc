"""Validation of token-weight inputs, shared by every trie implementation.

A weight vector has one floating-point entry per token (index = token id); a
batch is a 2-D array/tensor ``[B, V]`` or a sequence of such vectors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

Weights = np.ndarray | torch.Tensor


def weights_to_numpy(ws, num_tokens: int, *, batched: bool) -> np.ndarray:
    """``ws`` as a float64 numpy array: ``[V]``, or ``[B, V]`` when ``batched``.

    Accepts numpy arrays and CPU tensors of a floating dtype.

    Raises:
        TypeError: not an array/tensor, or a non-floating dtype.
        ValueError: wrong number of dimensions, wrong length, a tensor not on
            the CPU, or a NaN entry.
    """
    if batched and _is_sequence_of_vectors(ws):
        ws = np.stack([weights_to_numpy(row, num_tokens, batched=False) for row in ws])
    if isinstance(ws, torch.Tensor):
        if ws.device.type != "cpu":
            raise ValueError(
                f"weights are on {ws.device}, but this trie computes on the CPU; "
                "move them with .cpu() or use ParallelTokenCharacterTrie(device=...)"
            )
        _check_torch_dtype(ws.dtype)
        ws = ws.detach().to(torch.float64).numpy()
    elif isinstance(ws, np.ndarray):
        if not np.issubdtype(ws.dtype, np.floating):
            raise TypeError(f"weights must have a floating dtype, got {ws.dtype}")
    else:
        raise TypeError(f"weights must be a numpy array or torch tensor, got {type(ws).__name__}")
    _check_shape(tuple(ws.shape), num_tokens, batched)
    ws = np.asarray(ws, dtype=np.float64)
    if np.isnan(ws).any():
        raise ValueError(_nan_message(np.argwhere(np.isnan(ws))[0]))
    return ws


def weights_to_tensor(ws, num_tokens: int, *, batched: bool, device: torch.device) -> torch.Tensor:
    """``ws`` as a float32 tensor on ``device``: ``[V]``, or ``[B, V]`` when ``batched``.

    Accepts tensors already on ``device`` (any floating dtype) and numpy
    arrays (copied to ``device``).

    Raises:
        TypeError: not an array/tensor, or a non-floating dtype.
        ValueError: wrong number of dimensions, wrong length, a tensor on
            another device, or a NaN entry.
    """
    if batched and _is_sequence_of_vectors(ws):
        ws = torch.stack(
            [weights_to_tensor(row, num_tokens, batched=False, device=device) for row in ws]
        )
    if isinstance(ws, np.ndarray):
        if not np.issubdtype(ws.dtype, np.floating):
            raise TypeError(f"weights must have a floating dtype, got {ws.dtype}")
        ws = torch.from_numpy(ws)
    elif isinstance(ws, torch.Tensor):
        if ws.device != device:
            raise ValueError(
                f"weights are on {ws.device}, but this trie lives on {device}; "
                f"move them with .to({str(device)!r})"
            )
    else:
        raise TypeError(f"weights must be a torch tensor or numpy array, got {type(ws).__name__}")
    _check_torch_dtype(ws.dtype)
    _check_shape(tuple(ws.shape), num_tokens, batched)
    ws = ws.detach().to(device=device, dtype=torch.float32)
    if torch.isnan(ws).any():
        raise ValueError(_nan_message(torch.nonzero(torch.isnan(ws))[0].tolist()))
    return ws


def _is_sequence_of_vectors(ws) -> bool:
    if not isinstance(ws, Sequence) or isinstance(ws, str | bytes):
        return False
    if len(ws) == 0:
        raise ValueError("the batch of weights is empty")
    return True


def _check_torch_dtype(dtype: torch.dtype) -> None:
    if not dtype.is_floating_point:
        raise TypeError(f"weights must have a floating dtype, got {dtype}")


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
