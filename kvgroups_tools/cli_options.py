"""Checks of the ``kvgroups`` options, made while the command line is parsed.

Every option is refused before anything runs (no framework imported, nothing allocated, no
file written), in one line naming the option as typed (``--chunk``, ``--tpb``), with exit
status 2: the argparse ``type=`` functions here raise ``ArgumentTypeError`` and
:class:`OneLineParser` prints ``kvgroups plan: error: argument --chunk: expected ...`` without
the usage block. Sizes are bounded, and what a command would allocate is estimated from
descriptors (:func:`refuse_over_memory`) and refused when it exceeds the memory there is.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from kvgroups_core.errors import KVGroupsError, KVGroupsValueError
from kvgroups_core.grouping.shape_spec import parse_kvcache_shape_spec

#: Tokens per chunk, per block, in a window: far above any model, far below overflow.
MAX_TOKENS = 1 << 30
#: Layers of a model (as the shape-spec parser bounds them).
MAX_LAYERS = 1 << 16
#: Chunks of one request or benchmark point.
MAX_CHUNKS = 1 << 24


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (``PROG: error: MESSAGE``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


# --- argparse types ------------------------------------------------------------------------


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An int in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected an integer in [{low}, {high:,}], got {_short(value)}"
            )
        return value

    parse.__name__ = "integer"
    return parse


def float_in(
    low: float, high: float | None = None, *, open_low: bool = False
) -> Callable[[str], float]:
    """A finite float ``>= low`` (``> low`` with ``open_low``), ``<= high`` when given."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = value <= low if open_low else value < low
        if (
            value != value
            or value in (float("inf"), float("-inf"))
            or too_low
            or (high is not None and value > high)
        ):
            bound = f"> {low}" if open_low else f">= {low}"
            if high is not None:
                bound += f" and <= {high}"
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def int_list_in(low: int, high: int, *, allowed: Sequence[int] = ()) -> Callable[[str], list]:
    """Comma-separated ints, each in ``[low, high]`` or one of ``allowed`` (``-1`` = full)."""
    one = int_in(low, high)

    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",")]
        if not text.strip() or any(not t for t in items):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        out = []
        for t in items:
            try:
                value = int(t)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expected comma-separated integers, got {text!r}"
                ) from None
            out.append(value if value in allowed else one(t))
        return out

    parse.__name__ = "integer list"
    return parse


def names_in(choices: Sequence[str], what: str = "names") -> Callable[[str], list]:
    """Comma-separated names, each one of ``choices``."""

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected {what} from {list(choices)}, got none")
        unknown = [t for t in items if t not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"expected {what} from {list(choices)}, got {', '.join(map(repr, unknown))}"
            )
        return items

    parse.__name__ = what
    return parse


#: Dtype spellings accepted on the command line, as the shape-spec parser names them.
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "u8": "uint8",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
}


def normalize_spec(text: str) -> str:
    """A shape spec as typed, made what the parser reads: spaces dropped and dtype aliases
    (``bf16``, ``fp8`` ...) spelled out. The parser then checks everything else."""
    compact = re.sub(r"\s+", "", text)
    parts = []
    for part in compact.split(";"):
        fields = part.rsplit(":", 2)
        if len(fields) == 3 and fields[0].endswith(")"):
            fields[1] = DTYPE_ALIASES.get(fields[1].lower(), fields[1])
            part = ":".join(fields)
        parts.append(part)
    return ";".join(parts)


def shape_spec(text: str) -> str:
    """A shape spec, normalized and parsed once (its errors become the option's)."""
    spec = normalize_spec(text)
    try:
        parse_kvcache_shape_spec(spec)
    except KVGroupsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


shape_spec.__name__ = "shape spec"


def out_file(text: str) -> Path:
    """A file to write in a directory that exists (nothing is created on the way)."""
    file = Path(text)
    if file.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got the directory {text!r}")
    parent = file.parent if str(file.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"expected a file in an existing directory, got {text!r} ({str(parent)!r} does "
            "not exist)"
        )
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"expected a writable directory, got {text!r}")
    return file


out_file.__name__ = "file path"


# --- errors in the command line's terms ------------------------------------------------------


def refuse(option: str, message: str) -> NoReturn:
    """Raise the typed error the ``kvgroups`` command prints as ``OPTION: MESSAGE`` (exit 2)."""
    raise KVGroupsValueError(f"{option}: {message}")


def in_option_terms(
    exc: KVGroupsError, pick: dict[str, str], rename: dict[str, str], default: str
) -> KVGroupsError:
    """``exc`` said in the options' words: the library's argument names replaced by
    ``rename`` (``lmcache_tokens_per_chunk`` -> ``--chunk``, ``slots_per_block`` -> ``block
    size``; whole identifiers only), prefixed with the option of the first phrase of ``pick``
    it contains (``"sliding window"`` -> ``--sw``), else ``default``, unless it already starts
    with an option."""
    text = str(exc)
    found = [(text.find(k), opt) for k, opt in pick.items() if k in text]
    for key, words in rename.items():
        text = re.sub(rf"(?<![\w-]){re.escape(key)}(?![\w-])", words, text)
    if re.match(r"--[\w-]+(, --[\w-]+)*: ", text):
        return type(exc)(text)
    option = min(found)[1] if found else default
    return type(exc)(f"{option}: {text}")


# --- memory ----------------------------------------------------------------------------------


def available_memory() -> int | None:
    """Bytes of host memory available now (Linux ``MemAvailable``), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def total_memory() -> int | None:
    """Bytes of host memory in all, None when unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def nbytes_text(n: float) -> str:
    for unit, size in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 1024:,.1f} KiB"


def refuse_over_memory(
    option: str, need: int, parts: str, limit: int | None, limit_text: str
) -> None:
    """Refuse (naming ``option``) when ``need`` bytes exceed ``limit``."""
    if limit is not None and need > limit:
        refuse(
            option,
            f"expected sizes that fit in memory, got a run that needs about "
            f"{nbytes_text(need)} ({parts}), more than {limit_text} "
            f"({nbytes_text(limit)}); give smaller sizes or --max-memory GIB",
        )


def memory_limit(max_memory_gib: float | None, *, available: bool) -> tuple[int | None, str]:
    """``(bytes, description)`` of the memory a run may use: ``--max-memory``, else the
    host's available (or total) memory."""
    if max_memory_gib is not None:
        return int(max_memory_gib * (1 << 30)), "--max-memory"
    if available:
        return available_memory(), "the memory available"
    return total_memory(), "the host's memory"


def _short(n: int) -> str:
    """An int for a message: a number of thousands of digits cannot even be printed."""
    if n.bit_length() <= 96:
        return str(n)
    return f"a {int(n.bit_length() * 0.30103) + 1}-digit number"


def stdout_closed_quietly() -> None:
    """After a ``BrokenPipeError`` (``kvgroups plan --json | head``): point stdout at
    /dev/null so the interpreter's final flush raises nothing either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
