"""Checks of what enters the model, the trainers and the engines: token ids and batch layouts.

Every entry point runs these before computing anything, so that a bad input fails at the boundary
with one clear error that names the value, its position and what is allowed. Without them an
embedding lookup reads a negative id from the end of the table (``weight[-1]`` is row V-1, so id -1
gives the same bits as id V-1 on both sides, which no gate can see), and an id >= V raises
``IndexError`` deep inside a forward (in an in-process vLLM engine, a forward that raises leaves the
request scheduled with nothing to sample, and the next ``generate`` never returns).

One error class, :class:`InputError`, covers token ids and degenerate batches; messages of the
latter start with ``"empty input:"`` in every API (trainer, model, engines).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class InputError(ValueError):
    """A token id outside the vocabulary, a non-integer id, or an empty / degenerate batch."""


def _non_integer(ids: Any, where: tuple[int, ...] = ()) -> tuple[tuple[int, ...], Any] | None:
    """Position and value of the first id of a (nested) sequence that is not an integer, else None.

    Integers are Python ``int`` (``bool`` excluded) and numpy integer scalars; a numpy array counts by
    its dtype kind. Anything else -- ``bool`` / ``numpy.bool_``, floats, strings, None, tensors -- is not.
    """
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind in "iu" or ids.size == 0:
            return None
        return where + tuple(int(i) for i in np.unravel_index(0, ids.shape)), ids.flat[0]
    if all(type(x) is int for x in ids):  # the common case: a list of Python ints
        return None
    for i, x in enumerate(ids):
        if isinstance(x, np.ndarray) or (isinstance(x, Sequence) and not isinstance(x, (str, bytes))):
            bad = _non_integer(x, where + (i,))
            if bad is not None:
                return bad
        elif isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            return where + (i,), x
    return None


def _type_name(v: Any) -> str:
    t = type(v)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_token_ids(ids: torch.Tensor | Sequence[Any], vocab_size: int | None, what: str = "input_ids") -> None:
    """Refuse ids outside ``[0, vocab_size)`` and ids that are not integers.

    Args:
        ids: a tensor of any shape (integer dtype), or a (nested, rectangular) sequence / numpy array
            of ints (Python ``int`` or numpy integers).
        vocab_size: V, the model's vocabulary size; None checks the types only.
        what: the argument's name, used in the message.

    Raises:
        InputError: the first offending id with its position (an index per dimension) and V, e.g.
            ``"input_ids: token id -1 at position 3 is outside the vocabulary [0, 256) (V=256)"``
            (an index tuple for tensors of several dimensions);
            or an id that is not an integer, named with its type and position (``True``, ``1.0``,
            ``"7"``, ``numpy.bool_``: refused, never read as an integer), or a tensor / array whose
            dtype is not an integer type.
    """
    if not isinstance(ids, torch.Tensor):
        if isinstance(ids, (str, bytes)):
            raise InputError(f"{what}: token ids must be a sequence of integers, got {type(ids).__name__} {ids!r}")
        bad = _non_integer(ids)
        if bad is not None:
            pos, v = bad
            raise InputError(f"{what}: token id {v!r} at position {pos[0] if len(pos) == 1 else pos} is a "
                             f"{_type_name(v)}, not an integer")
    t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)
    if t.numel() == 0 and not isinstance(ids, torch.Tensor):
        return  # an empty list has no dtype of its own; emptiness is the callers' check
    if t.dtype not in _INT_DTYPES:
        raise InputError(f"{what}: token ids must be integers, got dtype {t.dtype}")
    if vocab_size is None:
        return
    bad = (t < 0) | (t >= vocab_size)
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        where = pos[0] if len(pos) == 1 else pos
        raise InputError(
            f"{what}: token id {int(t[pos])} at position {where} is outside the vocabulary "
            f"[0, {vocab_size}) (V={vocab_size})"
        )


def check_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], num_tokens: int) -> list[int]:
    """Validate the offsets of a packed (varlen) batch.

    Args:
        cu_seqlens: ``[B+1]`` int offsets ``(0, len_0, len_0+len_1, ...)``.
        num_tokens: T, the length of the packed ``input_ids``.

    Returns:
        The offsets as Python ints.

    Raises:
        InputError: no sequence (``cu_seqlens=[0]`` or ``[]``) or a sequence without tokens
            (``"empty input: ..."``); offsets that do not start at 0, decrease, or do not end at T.
    """
    cu = [int(c) for c in cu_seqlens]
    if len(cu) < 2:
        raise InputError(f"empty input: cu_seqlens={cu} holds no sequence; at least one sequence of at "
                         "least one token is required")
    if cu[0] != 0 or cu[-1] != num_tokens or any(b < a for a, b in zip(cu, cu[1:])):
        raise InputError(f"cu_seqlens must rise from 0 to len(input_ids)={num_tokens}, got {cu}")
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        if a == b:
            raise InputError(f"empty input: sequence {i} has no tokens (cu_seqlens[{i}] == cu_seqlens[{i + 1}] "
                             f"== {a}); every sequence needs at least one token")
    return cu


def check_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Validate a right-padded ``[B, L]`` mask (ones, then zeros, in every row).

    Returns:
        ``[B]`` int64 sequence lengths.

    Raises:
        InputError: B or L is 0, or a row is all zeros (``"empty input: ..."``); values other than
            0/1, or a row that is not right-padded.
    """
    if attention_mask.dim() != 2:
        raise InputError(f"attention_mask must be [B, L], got shape {tuple(attention_mask.shape)}")
    B, L = attention_mask.shape
    if B == 0 or L == 0:
        raise InputError(f"empty input: attention_mask of shape {(B, L)} holds no token; at least one "
                         "sequence of at least one token is required")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise InputError("attention_mask must hold only 0 and 1")
    lens = attention_mask.long().sum(-1)
    if not torch.equal(attention_mask.bool(), torch.arange(L, device=lens.device)[None, :] < lens[:, None]):
        raise InputError("attention_mask must be right-padded: ones then zeros in every row")
    empty = (lens == 0).nonzero()
    if empty.numel():
        raise InputError(f"empty input: attention_mask row {int(empty[0])} is all zeros; every sequence "
                         "needs at least one token")
    return lens


def check_generate_args(prompt_token_ids: Sequence[Sequence[int]], n: int, max_tokens: int,
                        vocab_size: int | None) -> None:
    """Validate a batch of generation requests (any engine: vLLM or the plain-PyTorch one).

    Args:
        prompt_token_ids: prompts as token id lists.
        n: samples per prompt. max_tokens: response length cap.
        vocab_size: V; None checks the ids' types only (the range is then the policy's forward's check).

    Raises:
        InputError: no prompt, a prompt without tokens, ``n < 1`` or ``max_tokens < 1``
            (``"empty input: ..."``); a token id outside ``[0, V)`` or not an integer (prompt index and
            position named).
    """
    if len(prompt_token_ids) == 0:
        raise InputError("empty input: prompt_token_ids holds no prompt; at least one prompt of at least one "
                         "token is required")
    if int(n) < 1:
        raise InputError(f"empty input: n={n} asks for no sample; n >= 1 is required")
    if int(max_tokens) < 1:
        raise InputError(f"empty input: max_tokens={max_tokens} asks for no token; max_tokens >= 1 is required")
    for i, p in enumerate(prompt_token_ids):
        if len(p) == 0:
            raise InputError(f"empty input: prompt {i} has no tokens; every prompt needs at least one token")
        check_token_ids(p, vocab_size, f"prompt {i}")
