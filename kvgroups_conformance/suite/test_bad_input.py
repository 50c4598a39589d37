"""Bad input is refused with a typed error before any byte moves: caches and objects stay
exactly as they were.

To add a case, append a row to the table it belongs to: :data:`BAD_IDS` (block ids),
:data:`BAD_OBJECTS` (object arrays), :data:`BAD_SKIPS` (``skip_first_n_tokens``), or
:data:`BAD_CALLS` for anything else (a :class:`BadCall`: a function making the bad call on the
shared :class:`Setup`, the error class and a fragment of its message). Every row runs against
every harness, and the suite checks both the error and that nothing changed.
"""

import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_conformance.caches import all_blocks, make_caches
from kvgroups_conformance.compare import block_mismatches, object_mismatches
from kvgroups_conformance.report import raise_if_any
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.engine_groups import EngineGroupInfo
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.objects import object_nbytes

CHUNK, BS, NB = 16, 4, 12
FMT = F.NL_X_TWO_NB_BS_NH_HS


@dataclass
class Setup:
    """A two-layer float16 manager, its caches and two chunks of random objects, as NumPy
    arrays (``*_np``) and as the harness's arrays."""

    harness: Any
    manager: Any
    caches_np: list
    objects_np: list
    caches: Any
    objects: Any
    formats: list

    def store(self, ids, objects=None, **kwargs):
        return self.harness.store(
            self.manager, self.caches, ids, self.objects if objects is None else objects, **kwargs
        )

    def load(self, ids, objects=None, skip=0):
        return self.harness.load(
            self.manager, self.objects if objects is None else objects, self.caches, ids, skip=skip
        )

    def assert_unchanged(self, what: str) -> None:
        got_caches = self.harness.read(self.caches, self.caches_np)
        got_objects = self.harness.to_numpy(self.objects[0], self.objects_np[0])
        raise_if_any(
            block_mismatches(
                got_caches,
                self.formats,
                all_blocks(self.caches_np, self.formats),
                what=f"{what}: caches changed",
            )
            + object_mismatches(
                got_objects, self.objects_np[0], self.manager, 0, what=f"{what}: objects changed"
            )
        )


@pytest.fixture
def setup(harness):
    rng = np.random.default_rng(9)
    caches_np, formats = make_caches(FMT, nl=2, nb=NB, bs=BS, nh=2, hs=8, dtype="float16", rng=rng)
    manager = KVLayerGroupsManager(caches_np, formats, lmcache_tokens_per_chunk=CHUNK)
    objects_np = [rng.integers(0, 256, (2, object_nbytes(manager, 0)), dtype=np.uint8)]
    return Setup(
        harness,
        manager,
        caches_np,
        objects_np,
        harness.convert(caches_np),
        harness.convert(objects_np),
        formats,
    )


def _raises(error, text, call):
    with pytest.raises(error, match=r"(?i)" + re.escape(text)) as info:
        call()
    # The project's rule: every refusal is a KVGroupsError as well as the builtin.
    assert isinstance(info.value, kc.KVGroupsError), type(info.value).__mro__


# Block ids: (ids, error, message fragment). A list of two lists means {engine group 1: ...}.
BAD_IDS = [
    ([0, 1, 2, 3, 4, 5, 6, NB], kc.KVGroupsIndexError, "expected ids in"),
    ([0, 1, 2, -1, 4, 5, 6, 7], kc.KVGroupsIndexError, "expected ids in"),
    ([0, 1, 2, 3, 4], kc.KVGroupsValueError, "multiple of 4"),
    ([0, 1, 2, 3], kc.KVGroupsValueError, "uint8 [1,"),  # one chunk for two-chunk objects
    ([[0, 1], [2, 3]], kc.KVGroupsValueError, "missing"),
]


@pytest.mark.parametrize("ids,error,text", BAD_IDS)
def test_bad_block_ids_raise_before_any_byte_moves(harness, setup, ids, error, text):
    ids = ids if isinstance(ids[0], list) else np.array(ids)
    if isinstance(ids, list):
        ids = {1: ids[0]}
    _raises(error, text, lambda: setup.store(ids))
    setup.assert_unchanged(f"store with bad block ids {ids}")
    _raises(error, text, lambda: setup.load(ids))
    setup.assert_unchanged(f"load with bad block ids {ids}")


# Objects that do not fit the manager: functions of object_nbytes(manager, 0).
BAD_OBJECTS = [
    lambda n: [np.zeros((2, n + 1), np.uint8)],  # one byte too many per chunk
    lambda n: [np.zeros((2, n // 2), np.uint16)],  # right size, wrong dtype
    lambda n: [np.zeros((3, n), np.uint8)],  # a chunk too many
    lambda n: [],  # no object group
]


def test_bad_object_shapes_and_dtypes_are_rejected(harness, setup):
    nbytes = object_nbytes(setup.manager, 0)
    ids = np.arange(8)
    for make in BAD_OBJECTS:
        bad = harness.convert(make(nbytes))
        _raises(kc.KVGroupsValueError, "objects", lambda bad=bad: setup.load(ids, bad))
        _raises(kc.KVGroupsValueError, "objects", lambda bad=bad: setup.store(ids, bad))
        setup.assert_unchanged(f"bad objects {make(nbytes)!r:.80}")


# skip_first_n_tokens outside [0, covered tokens].
BAD_SKIPS = [-1, 2 * CHUNK + 1]


def test_skip_outside_the_covered_tokens_is_rejected(harness, setup):
    for skip in BAD_SKIPS:
        _raises(
            kc.KVGroupsValueError,
            "skip_first_n_tokens",
            lambda skip=skip: setup.load(np.arange(8), skip=skip),
        )
        setup.assert_unchanged(f"load with skip_first_n_tokens={skip}")


@dataclass(frozen=True)
class BadCall:
    """One bad call: ``call(setup)`` must raise ``error`` with ``text`` in its message."""

    id: str
    call: Callable[[Setup], Any]
    error: type
    text: str


BAD_CALLS = [
    BadCall(
        "store-float-ids",
        lambda s: s.store(np.arange(8, dtype=np.float32)),
        kc.KVGroupsTypeError,
        "block_ids",
    ),
    BadCall("load-bool-ids", lambda s: s.load(np.ones(8, bool)), kc.KVGroupsTypeError, "block_ids"),
    BadCall(
        "load-2d-ids",
        lambda s: s.load(np.arange(8).reshape(2, 4)),
        kc.KVGroupsTypeError,
        "block_ids",
    ),
    BadCall(
        "load-float-skip",
        lambda s: s.load(np.arange(8), skip=1.5),
        kc.KVGroupsTypeError,
        "skip_first_n_tokens",
    ),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=lambda c: c.id)
def test_bad_call_is_refused_and_moves_nothing(harness, setup, case):
    _raises(case.error, case.text, lambda: case.call(setup))
    setup.assert_unchanged(case.id)


def test_caches_that_do_not_match_the_manager_are_rejected(harness, setup):
    other_np, formats = make_caches(
        FMT, nl=2, nb=NB, bs=BS, nh=4, hs=8, dtype="float16", rng=np.random.default_rng(1)
    )
    other = harness.convert(other_np)
    _raises(
        kc.KVGroupsValueError,
        "as the manager was built with",
        lambda: harness.load(setup.manager, setup.objects, other, np.arange(8)),
    )
    raise_if_any(
        block_mismatches(
            harness.read(other, other_np),
            formats,
            all_blocks(other_np, formats),
            what="load into mismatched caches changed them",
        )
    )
    setup.assert_unchanged("load into mismatched caches")


def test_flat_ids_need_a_single_engine_group(harness):
    rng = np.random.default_rng(2)
    caches_np, formats = make_caches(FMT, nl=2, nb=NB, bs=BS, nh=2, hs=8, dtype="float16", rng=rng)
    infos = (
        EngineGroupInfo(engine_group_id=0, layer_indices=(0,)),
        EngineGroupInfo(engine_group_id=1, layer_indices=(1,)),
    )
    manager = KVLayerGroupsManager(caches_np, formats, infos, lmcache_tokens_per_chunk=CHUNK)
    _raises(
        kc.KVGroupsValueError,
        "one id list per engine group",
        lambda: harness.store(manager, harness.convert(caches_np), np.arange(4)),
    )
