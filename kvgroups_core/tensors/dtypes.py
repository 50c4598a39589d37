"""Element types as plain data, keyed by their DLPack code and width.

No framework dtype ever enters a spec: a :class:`DType` is what the core compares, hashes
and prints. Frameworks' dtypes are mapped to it by name (``torch.bfloat16`` ->
``"bfloat16"``) or by their DLPack ``(code, bits)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError

# DLPack DLDataTypeCode values (dlpack.h).
DL_INT = 0
DL_UINT = 1
DL_FLOAT = 2
DL_BFLOAT = 4
DL_BOOL = 6
DL_FLOAT8_E4M3FN = 10
DL_FLOAT8_E5M2 = 12


@dataclass(frozen=True)
class DType:
    """An element type: its canonical name, DLPack type code and width in bits.

    Equality and hashing are by value, so a ``DType`` read from a torch tensor equals the one
    read from a JAX array or written in a shape spec.
    """

    name: str
    code: int
    bits: int
    lanes: int = 1

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.bits * self.lanes // 8

    @property
    def uint_view_name(self) -> str:
        """The unsigned integer type of the same width ("uint16" for bfloat16)."""
        return f"uint{self.bits * self.lanes}"

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DType({self.name})"


_ALL = (
    DType("float16", DL_FLOAT, 16),
    DType("bfloat16", DL_BFLOAT, 16),
    DType("float32", DL_FLOAT, 32),
    DType("float64", DL_FLOAT, 64),
    DType("float8_e4m3fn", DL_FLOAT8_E4M3FN, 8),
    DType("float8_e5m2", DL_FLOAT8_E5M2, 8),
    DType("uint8", DL_UINT, 8),
    DType("uint16", DL_UINT, 16),
    DType("uint32", DL_UINT, 32),
    DType("uint64", DL_UINT, 64),
    DType("int8", DL_INT, 8),
    DType("int16", DL_INT, 16),
    DType("int32", DL_INT, 32),
    DType("int64", DL_INT, 64),
    DType("bool", DL_BOOL, 8),
)

#: Every dtype kvgroups knows, by canonical name.
DTYPE_MAP: dict[str, DType] = {d.name: d for d in _ALL}

_BY_CODE = {(d.code, d.bits, d.lanes): d for d in _ALL}

# Spellings other libraries use for the same types.
_ALIASES = {
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
}


def as_dtype(value: object) -> DType:
    """Resolve a :class:`DType`, a name, or a framework dtype (``torch.bfloat16``,
    ``numpy.dtype('float16')``, ``jnp.bfloat16``) to a :class:`DType`."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        name = value.strip().lower()
    else:
        # Framework dtypes print or name themselves after the numpy spelling:
        # torch.bfloat16 -> "torch.bfloat16", np.dtype("float16").name -> "float16".
        name = getattr(value, "name", None) or str(value)
        if not isinstance(name, str):
            raise KVGroupsTypeError(f"dtype: expected a DType, a name or a dtype, got {value!r}")
        name = name.rsplit(".", 1)[-1].lower()
    name = _ALIASES.get(name, name)
    try:
        return DTYPE_MAP[name]
    except KeyError:
        raise KVGroupsValueError(
            f"dtype: expected one of {sorted(DTYPE_MAP)}, got {value!r}"
        ) from None


def from_dlpack_code(code: int, bits: int, lanes: int = 1) -> DType:
    """The :class:`DType` of a DLPack ``DLDataType``."""
    try:
        return _BY_CODE[(int(code), int(bits), int(lanes))]
    except KeyError:
        raise KVGroupsValueError(
            f"dlpack dtype: expected a known (code, bits, lanes), got {(code, bits, lanes)}"
        ) from None
