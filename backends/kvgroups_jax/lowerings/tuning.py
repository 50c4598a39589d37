"""The lowerings' tuning: one frozen value, passed explicitly from ``JaxBackend`` to the kernels.

``JaxBackend(tuning=LoweringTuning(...))`` hands it to every transfer program it builds; it is
part of the program's key, so backends of different tunings compile apart and nothing needs
``jax.clear_caches()``. The defaults are the shipped ones (docs/PERFORMANCE.md, "Where the
defaults come from"); a benchmark or test passes another value, never edits a module.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError


@dataclass(frozen=True)
class LoweringTuning:
    """Launch shapes of the Pallas Triton and the ``"cuda"`` lowerings.

    Parameters
    ----------
    small_page_bytes : int, default 1024
        Triton: block-planes of at most this many bytes run the small-page kernel (several
        items per program, their ids read as one vector); 0 keeps one item per program.
    items_per_program : int, default 8
        Triton: items one program of the small-page kernel moves, rounded down to a power of
        two (and capped by the item bucket and the largest array op); 1 keeps one item per
        program.
    resident_waves : int or None, default None
        ``"cuda"``: None sizes the grid at one warp per unit of the largest call; N caps it
        at N waves of resident CTAs, whose warps then loop over the units.
    """

    small_page_bytes: int = 1024
    items_per_program: int = 8
    resident_waves: int | None = None

    def __post_init__(self) -> None:
        for name, least in (("small_page_bytes", 0), ("items_per_program", 1)):
            _check_int(name, getattr(self, name), least)
        if self.resident_waves is not None:
            _check_int("resident_waves", self.resident_waves, 1)


def _check_int(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVGroupsTypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < least:
        raise KVGroupsValueError(f"{name}: expected an int >= {least}, got {value}")


#: The shipped tuning.
DEFAULT_TUNING = LoweringTuning()
