"""What a failing conformance case tells a backend author: where the first wrong byte is.

A :class:`Mismatch` names the engine format, dtype, layer, plane (K or V), engine block and the
first differing byte inside that block's token rows, with the expected and actual byte values,
how many blocks differ in the same comparison and, when the wrong bytes are recognisable, a
hint (``"holds the bytes of source block 7"``: an addressing error). A case that finds
mismatches raises :class:`ConformanceFailure`, an ``AssertionError`` that carries them, so
pytest, the kit's plugin and its JSON report all read the same records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    """The first wrong byte of one comparison.

    ``byte`` counts inside the block's token rows as they are laid out in an object (token
    ``token``, then byte ``byte % row_bytes`` of its row). For object comparisons
    ``object_group``, ``chunk`` and ``object_byte`` say where in the object it was found.
    """

    what: str
    format: str
    dtype: str
    layer: int
    plane: int
    plane_name: str
    block: int | None
    byte: int
    token: int
    expected: int
    actual: int
    differing_blocks: int = 1
    object_group: int | None = None
    chunk: int | None = None
    object_byte: int | None = None
    hint: str = ""

    def describe(self) -> str:
        where = (
            f"format {self.format}, dtype {self.dtype}, layer {self.layer}, "
            f"plane {self.plane} ({self.plane_name}), "
            f"block {'?' if self.block is None else self.block}, byte {self.byte} "
            f"(token {self.token})"
        )
        found = ""
        if self.object_group is not None:
            found = (
                f" [object group {self.object_group}, chunk {self.chunk}, "
                f"object byte {self.object_byte}]"
            )
        text = (
            f"{self.what}: first difference at {where}{found}: expected "
            f"0x{self.expected:02x}, got 0x{self.actual:02x}; "
            f"{self.differing_blocks} block(s) differ"
        )
        return f"{text}; {self.hint}" if self.hint else text

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ConformanceFailure(AssertionError):
    """A case moved wrong bytes: ``mismatches`` says where (the first of each comparison)."""

    def __init__(self, mismatches: list[Mismatch]) -> None:
        self.mismatches = list(mismatches)
        super().__init__("\n".join(m.describe() for m in self.mismatches))


def raise_if_any(mismatches: list[Mismatch]) -> None:
    """Raise :class:`ConformanceFailure` for a non-empty list of mismatches."""
    if mismatches:
        raise ConformanceFailure(mismatches)


def case_record(
    nodeid: str, params: dict[str, Any], outcome: str, error: BaseException | None
) -> dict[str, Any]:
    """One JSON-ready row of the kit's report: the case, its parameters, what went wrong."""
    row: dict[str, Any] = {
        "case": nodeid,
        "outcome": outcome,
        "params": {k: _plain(v) for k, v in params.items()},
    }
    if isinstance(error, ConformanceFailure):
        row["mismatches"] = [m.as_dict() for m in error.mismatches]
    elif error is not None:
        row["error"] = f"{type(error).__name__}: {error}"
    return row


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    name = getattr(value, "name", None)  # formats (enums), harnesses
    if isinstance(name, str):
        return name
    ident = getattr(value, "id", None)
    return ident if isinstance(ident, str) else repr(value)


def format_case(row: dict[str, Any]) -> list[str]:
    """Lines of the terminal report for one failing case."""
    lines = [f"FAILED {row['case']}"]
    for m in row.get("mismatches", ()):
        lines.append("    " + Mismatch(**m).describe())
    if "error" in row:
        text = [line.strip() for line in row["error"].splitlines() if line.strip()]
        lines.append(f"    raised {' | '.join(text[:4])[:600]}")
    return lines
