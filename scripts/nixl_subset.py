"""Make the part of NIXL's wheel that UCX transfers need, small enough to carry to a machine
that cannot download (the H200: at most 64 MiB travels with the repository, the whole
``nixl-cu13`` wheel is 56 MiB and the checkout about 7 MiB).

    python scripts/nixl_subset.py            # -> .whl/nixl_cu13_min.zip (about 12 MiB)

It downloads ``nixl-cu13==1.5.1`` for CPython 3.12 with pip, keeps the Python package, the UCX
and POSIX plugins and every shared library they load (by their ELF ``NEEDED`` entries,
transitively), and UCX's shared-memory and CUDA transport modules; it leaves out NIXL-EP, the
storage and cloud plugins and UCX's InfiniBand modules. On the other machine::

    python3 -m zipfile -e .whl/nixl_cu13_min.zip /tmp/site && export PYTHONPATH=/tmp/site

Needs ``readelf`` (binutils) here.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_UCX = re.compile(r"perftest|_ib|rdmacm|mlx5|efa|gdr")


def needed(path: Path) -> list[str]:
    out = subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return re.findall(r"\(NEEDED\).*\[(.*)\]", out)


def subset(unpacked: Path, tag: str) -> list[Path]:
    """Files (relative to ``unpacked``) the UCX path loads."""
    pkg, libs = f"nixl_{tag}", f"nixl_{tag}.libs"
    index: dict[str, Path] = {}
    for path in sorted(unpacked.rglob("*.so*")):
        if "nixl_ep" not in path.parts[len(unpacked.parts)]:
            index.setdefault(path.name, path)
    start = list((unpacked / pkg).glob("*.so"))
    for plugins in (unpacked / libs / "nixl", unpacked / f".{pkg}.mesonpy.libs" / "plugins"):
        start += [plugins / name for name in ("libplugin_UCX.so", "libplugin_POSIX.so")]
    start += [
        p for p in (unpacked / libs / "ucx").glob("*.so.0.0.0") if not SKIP_UCX.search(p.name)
    ]
    seen: set[Path] = set()
    todo = [p for p in start if p.exists()]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += [index[name] for name in needed(path) if name in index]
    files = {p.relative_to(unpacked) for p in seen}
    files |= {
        p.relative_to(unpacked) for p in (unpacked / pkg).iterdir() if p.suffix in (".py", ".typed")
    }
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", default="cu13", help="cu13 (CUDA 13) or cu12")
    ap.add_argument("--version", default="1.5.1")
    ap.add_argument("--python", default="3.12")
    ap.add_argument("--out", default=str(ROOT / ".whl"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                args.python,
                "--platform",
                "manylinux_2_28_x86_64",
                "-d",
                tmp,
                f"nixl-{args.tag}=={args.version}",
            ],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(unpacked)
        files = subset(unpacked, args.tag)
        target = out / f"nixl_{args.tag}_min.zip"
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as z:
            for rel in files:
                z.write(unpacked / rel, str(rel))
        raw = sum((unpacked / rel).stat().st_size for rel in files)
        print(
            f"{target}: {len(files)} files, {raw / 2**20:.1f} MiB unpacked, "
            f"{target.stat().st_size / 2**20:.1f} MiB zipped (wheel "
            f"{wheel.stat().st_size / 2**20:.1f} MiB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
