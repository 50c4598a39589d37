"""Fingerprints of bound torch tensors: what a binding depends on, compared on every call.

A binding derives addresses, block strides and row layouts from each cache tensor, so a
tensor changed in place must be noticed before the next call moves a byte with the old
layout: ``resize_`` (smaller keeps the address), ``.data = x.view(dtype)`` (same address, new
dtype and shape), ``as_strided_``, ``set_`` and ``requires_grad_`` (a fresh call refuses
autograd tensors). The fingerprint of a tensor is therefore its address (storage and offset),
shape, strides, dtype and ``requires_grad``.

Reading all of that from Python builds new objects per tensor (``shape`` and ``stride()``),
several times the cost of the address alone, and a whole-model call compares 32-128 tensors. So a
:class:`Fingerprints` also carries a fast check: the addresses (one ``map``) and a
``TensorGuards`` of torch's own compiler guards, which compares sizes, strides, dtype,
device, ``requires_grad`` and dispatch keys in C++. A pass of both proves the full
fingerprints equal. A failure is confirmed against the full fingerprints (the guard also
depends on thread-local state: a guard made outside ``torch.inference_mode`` fails inside it),
and on a confirmed match the guard is made again in the caller's state. Without the guard
class (another torch), the full comparison is the check.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

_DATA_PTR = torch.Tensor.data_ptr
_SIZE = torch.Tensor.size
_STRIDE = torch.Tensor.stride

try:  # torch's compiler guards (C++); absent or changed in another release: full compares
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - depends on the torch build
    _TensorGuards = None


class TensorKey(NamedTuple):
    """One bound tensor's fingerprint (``address`` includes the storage offset)."""

    address: int
    shape: tuple
    strides: tuple
    dtype: Any
    requires_grad: bool


class Fingerprints(list):
    """One :class:`TensorKey` (or None for a non-tensor) per tensor, compared as a list; plus
    the fast check's state (see the module docstring)."""

    __slots__ = ("ptrs", "guard")


def _key(x: Any) -> TensorKey | None:
    if not isinstance(x, torch.Tensor):
        return None
    return TensorKey(_DATA_PTR(x), tuple(_SIZE(x)), _STRIDE(x), x.dtype, x.requires_grad)


def _guard(xs: Sequence[Any]) -> Any:
    """A ``TensorGuards`` of plain tensors ``xs`` in the current thread-local state, or None."""
    if _TensorGuards is None or not xs or any(type(x) is not torch.Tensor for x in xs):
        return None
    try:
        guard = _TensorGuards(
            *xs,
            dynamic_dims_sizes=[list(_SIZE(x)) for x in xs],
            dynamic_dims_strides=[list(_STRIDE(x)) for x in xs],
        )
        return guard if guard.check(*xs) else None
    except Exception:  # noqa: BLE001 - any incompatibility: the full comparison decides
        return None


def fingerprints(xs: Sequence[Any]) -> Fingerprints:
    """The fingerprints of ``xs`` (raises like ``data_ptr`` for tensors without storage). The
    fast check is made by the first comparison that needs it (object checks, which only
    compare fingerprints once, never pay for it)."""
    out = Fingerprints(map(_key, xs))
    out.ptrs = [None if k is None else k.address for k in out]
    out.guard = None  # None: not made yet; False: none possible for these tensors
    return out


def same_fingerprints(xs: Sequence[Any], keys: Any) -> bool:
    """Whether ``xs`` still have the fingerprints ``keys`` (from :func:`fingerprints`)."""
    try:  # the per-call case, kept to a few operations (one tensor: a layer's call)
        guard = keys.guard
        if guard:
            if len(xs) == 1:
                x = xs[0]
                if _DATA_PTR(x) == keys.ptrs[0] and guard.check(x):
                    return True
            elif list(map(_DATA_PTR, xs)) == keys.ptrs and guard.check(*xs):
                return True
    except (AttributeError, TypeError, RuntimeError):
        pass  # other keys, or tensors without storage now: the full comparison decides
    return _same_in_full(xs, keys)


def _same_in_full(xs: Sequence[Any], keys: Any) -> bool:
    try:
        now = fingerprints(xs)
    except RuntimeError:  # a tensor without storage now: changed
        return False
    if now != keys:
        return False
    if type(keys) is Fingerprints and keys.guard is not False:
        # Made (again) in the caller's thread-local state, for the next call.
        keys.guard = (_guard(xs) if None not in keys.ptrs else None) or False
    return True
