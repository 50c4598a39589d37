"""The adversarial suite, threads (issue 35, cause 3): the engine's cache list replaced by
another thread while a transfer binds it.

A prepared transfer (and a one-shot call, which binds or takes back a parked binding) reads
the engine's list to bind it and to remember what it bound. Read twice, a thread replacing
entries in between left a binding of some old tensors under a guard holding the new ones:
every later call then moved the old tensors' bytes, and nothing ever noticed. Each trial here
races a replacement against a binding, waits for both, and then requires the next call to move
exactly the tensors the list holds by then. Many short trials with a tiny thread switch
interval; the replaced tensors stay alive (an engine may hold them elsewhere).
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_core.formats.catalogue import EngineKVFormat as F

NL, SHAPE, CHUNK = 8, (2, 8, 2, 1, 4), 4
IDS = np.arange(2)  # one chunk of two blocks
TRIALS = 120


def _arrays(kind: str, generation: int) -> list:
    out = [np.full(SHAPE, generation * 100 + i, np.float16) for i in range(NL)]
    if kind == "torch":
        torch = pytest.importorskip("torch")
        pytest.importorskip("kvgroups_torch")
        out = [torch.from_numpy(x) for x in out]
    return out


def _bytes(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _replace(start: threading.Event, caches: list, new: list, pause: bool) -> None:
    start.wait()
    for i in range(NL):
        caches[i] = new[i]
        if pause:
            time.sleep(0)


def _race(kind: str, call, pause: bool) -> int:
    """Trials where the call after the race moved bytes other than the list's tensors'."""
    manager = kc.KVLayerGroupsManager(
        _arrays(kind, 0), F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK
    )
    torn = 0
    for _ in range(TRIALS):
        caches = _arrays(kind, 1)
        keep = list(caches)  # the replaced tensors stay alive, as an engine's may
        new = _arrays(kind, 2)
        start = threading.Event()

        thread = threading.Thread(target=_replace, args=(start, caches, new, pause))
        thread.start()
        start.set()
        handle = call(manager, caches, None)
        thread.join()
        out = call(manager, caches, handle)
        want = kc.prepare(manager, list(new)).store(IDS)  # leaves the manager's park alone
        if not np.array_equal(_bytes(out[0]), _bytes(want[0])):
            torn += 1
        del keep
    return torn


def _prepared(manager, caches, handle):
    if handle is None:
        return kc.prepare(manager, caches)  # binds while the other thread replaces
    return handle.store(IDS)


def _one_shot(manager, caches, handle):
    out = kc.store(manager, caches, IDS)  # binds (or takes back a park) while replaced
    return out if handle is not None else True


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("pause", [False, True], ids=["tight", "yielding"])
def test_a_list_replaced_while_a_prepared_transfer_binds_is_noticed(kind, pause, fast_switching):
    assert _race(kind, _prepared, pause) == 0


@pytest.mark.parametrize("pause", [False, True], ids=["tight", "yielding"])
def test_a_list_replaced_while_a_one_shot_call_binds_is_noticed(pause, fast_switching):
    # torch: a park keeps weak references, so the replaced tensors (alive) could be taken
    # back under the new list's entries.
    assert _race("torch", _one_shot, pause) == 0
