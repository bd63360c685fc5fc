"""A level's attention split along its keys: chunks over many programs, merged by log-sum-exp.

A level (a cached prefix held once, read by many rows: the prompt in front
of every particle) is read once a step for all of its rows' queries
(:mod:`~genlm_backend.llm.hf.attention`). In one flash call that read runs on
one program per block of queries and key/value head: at 64 rows and 8
key/value heads a few dozen programs, far fewer than a GPU has
multiprocessors, so a 4,096-token level was read at about 15% of the
memory bandwidth. FlashInfer's cascade attention and Hydragen (Juravsky et
al. 2024) split the level along its keys instead: each chunk of keys is read
by its own programs, which give the chunk's attention output and
log-sum-exp, and the chunks are merged by their log-sum-exps, exactly as
:func:`~genlm_backend.llm.hf.attention.cascade_attention` merges a level with
the rest.

This module holds what needs no Triton: where the split kernel runs
(:func:`uses_split_kernel`), the inputs' checks, and the same split and merge
in torch operations (:func:`split_level_reference`), against which the
kernel (:mod:`~genlm_backend.llm.hf.split_level_fused`) is tested.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
"""The kernel's head sizes: powers of two in this range (its tiles); others take torch's path."""


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def supports_head_dim(head_dim: int) -> bool:
    """Whether the split kernel's tiles fit heads of ``head_dim``: a power of two from 16 to 256."""
    return MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0


def uses_split_kernel(device: torch.device, head_dim: int) -> bool:
    """Whether a level's attention on ``device`` runs the split kernel.

    On CUDA where Triton is installed (torch's CUDA wheels bring it), for
    head sizes :func:`supports_head_dim` accepts. Elsewhere the level is read
    by torch's kernels as before: on the CPU its fused flash kernel, whose
    programs already split the work among the cores. Nothing here imports Triton.
    """
    return device.type == "cuda" and supports_head_dim(head_dim) and _triton_installed()


def check_level_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the problem unless ``query`` ``[N, Hq, D]`` can attend to one
    level's ``key`` and ``value`` ``[Hkv, S, D]``: one device, one floating dtype of
    :data:`SUPPORTED_DTYPES`, ``Hq`` a multiple of ``Hkv``."""
    if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"expected query [N, Hq, D] and key, value [Hkv, S, D]; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"query's head size {query.shape[2]} is not the keys' {key.shape[2]}")
    if key.shape[0] == 0 or query.shape[1] % key.shape[0]:
        raise ValueError(
            f"{query.shape[1]} query heads are not a multiple of {key.shape[0]} key/value heads"
        )
    dtypes = {query.dtype, key.dtype, value.dtype}
    if len(dtypes) != 1 or query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"expected one dtype of {SUPPORTED_DTYPES}; got {sorted(map(str, dtypes))}"
        )
    if len({query.device, key.device, value.device}) != 1:
        raise ValueError(
            f"query, key and value are on {query.device}, {key.device} and {value.device}"
        )


def split_level_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, chunk_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's function in torch operations (float32): each chunk of ``chunk_keys``
    keys attended to alone, the chunks merged by :func:`merge_chunks`.

    Args:
        query: ``[N, Hq, D]``; query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
        key: One level's keys, ``[Hkv, S, D]``, all visible to every query.
        value: Its values, ``[Hkv, S, D]``.
        scale: Multiplies every score.
        chunk_keys: Keys a chunk (the last one holds what is left).

    Returns:
        ``[N, Hq, D]`` in ``query``'s dtype and each query's log-sum-exp of scores
        ``[N, Hq]`` (float32); with no keys, zeros and ``-inf`` (the level then
        weighs nothing in a merge).

    Raises:
        ValueError: inputs :func:`check_level_inputs` refuses, or ``chunk_keys < 1``.
    """
    check_level_inputs(query, key, value)
    if chunk_keys < 1:
        raise ValueError(f"chunk_keys must be positive, got {chunk_keys}")
    num_rows, num_q_heads, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[:2]
    # [N, Hkv, g, D] -> [Hkv, N * g, D]: each key/value head's queries together
    grouped = query.float().view(num_rows, num_kv_heads, -1, head_dim).transpose(0, 1)
    grouped = grouped.reshape(num_kv_heads, -1, head_dim)
    outputs, lses = [], []
    for start in range(0, num_keys, chunk_keys):
        keys = key[:, start : start + chunk_keys].float()
        values = value[:, start : start + chunk_keys].float()
        scores = grouped @ keys.transpose(1, 2) * scale  # [Hkv, N * g, chunk]
        outputs.append(torch.softmax(scores, dim=-1) @ values)
        lses.append(scores.logsumexp(dim=-1))
    if outputs:
        output, lse = merge_chunks(torch.stack(outputs), torch.stack(lses))
    else:
        output = grouped.new_zeros(grouped.shape)
        lse = grouped.new_full(grouped.shape[:2], -torch.inf)
    # [Hkv, N * g, ...] -> [N, Hq, ...]
    output = output.view(num_kv_heads, num_rows, -1, head_dim).transpose(0, 1)
    lse = lse.view(num_kv_heads, num_rows, -1).transpose(0, 1)
    return output.reshape(num_rows, num_q_heads, head_dim).to(query.dtype), lse.reshape(
        num_rows, num_q_heads
    )


def merge_chunks(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of ``C`` disjoint key sets from each one's: ``outputs``
    ``[C, ..., D]`` and log-sum-exps ``lses`` ``[C, ...]`` (float32) to ``[..., D]`` and ``[...]``.

    Each set's output weighs ``exp(lse_c - lse)``, its share of the softmax
    mass; a query no set gives a key to gets zeros and ``-inf``.
    """
    lse = torch.logsumexp(lses, dim=0)
    shares = torch.exp(lses - lse).nan_to_num(0.0)  # -inf - -inf: a query no set scored
    return (shares[..., None] * outputs).sum(dim=0), lse
