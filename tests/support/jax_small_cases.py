"""The Triton small-page kernel's test pieces, shared by its interpret-mode and GPU tests:
the pages, a group of one page size, and a fixture body that selects the kernel and records
the items per program of each launch."""

import jax
from kvgroups_jax.lowerings import triton as pallas_copy
from kvgroups_jax.lowerings.tuning import LoweringTuning

from tests.support.jax_layouts import make_group

# (bs, nh, hs) of bf16 pages: 512 B, 1 KiB, 2 KiB per block and plane.
PAGES = {512: (16, 1, 16), 1024: (16, 1, 32), 2048: (16, 2, 32)}


class SmallKernelLaunches(list):
    """The items per program of every small-page launch, and the tuning that selects the
    small-page kernel (pass it to the calls: ``tuning=small.tuning``)."""

    def __init__(self, tuning: LoweringTuning) -> None:
        super().__init__()
        self.tuning = tuning


def select_small_kernel(monkeypatch, items_per_program: int):
    """Pages up to 4 KiB take the small-page kernel with ``items_per_program`` under the
    yielded launches' ``tuning``; yields the items per program of every launch (a fixture
    body)."""
    calls = SmallKernelLaunches(
        LoweringTuning(small_page_bytes=4096, items_per_program=items_per_program)
    )
    real = pallas_copy._pallas_copy_small

    def counted(*args, **kw):
        calls.append(args[-1])  # items per program
        return real(*args, **kw)

    monkeypatch.setattr(pallas_copy, "_pallas_copy_small", counted)
    jax.clear_caches()  # traced again, so the launches are counted
    yield calls
    jax.clear_caches()


def object_nbytes(g):
    return g.num_planes * g.slots * g.row_bytes


def small_group(page, layout="nhd", **kw):
    bs, nh, hs = PAGES[page]
    return make_group(layout, "bfloat16", bs=bs, nh=nh, hs=hs, **kw)
