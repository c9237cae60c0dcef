"""The family's corpus: the `*.py` files of a Python standard library, split by file.

The source is the running interpreter's stdlib, another stdlib folder, or a `.tar.gz` made by
`pack_corpus` (so the build machine's stdlib, test suite included, can travel to a GPU machine whose
Python ships without one). The split depends only on each file's path relative to the stdlib root:
every member, on every machine, sees the same train / validation / held-out files. Validation steers
training choices (loss curves, picking a run); held-out files are only ever scored at the end.

    python -m tools.tiny_family.corpus --pack .carry/stdlib.tar.gz   # pack this interpreter's stdlib
"""

import argparse
import hashlib
import io
import json
import pathlib
import sys
import sysconfig
import tarfile
from dataclasses import dataclass

HELD_OUT_PER_MILLE = 20  # ~2% of files
VALIDATION_PER_MILLE = 20  # another ~2%
INFO_MEMBER = "CORPUS_INFO.json"
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Document:
    path: str  # posix path relative to the stdlib root
    text: str

    @property
    def num_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclass(frozen=True)
class Corpus:
    source: str
    python_version: str
    train: list[Document]
    validation: list[Document]
    held_out: list[Document]
    num_skipped: int  # files that are empty or not valid UTF-8

    def summary(self) -> dict:
        stats = {"source": self.source, "python_version": self.python_version, "skipped_files": self.num_skipped}
        for name in ("train", "validation", "held_out"):
            docs = getattr(self, name)
            stats |= {f"{name}_files": len(docs), f"{name}_bytes": sum(d.num_bytes for d in docs)}
        return stats


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    bucket = int(hashlib.sha256(relative_path.encode("utf-8")).hexdigest()[:8], 16) % 1000
    if bucket < HELD_OUT_PER_MILLE:
        return "held_out"
    return "validation" if bucket < HELD_OUT_PER_MILLE + VALIDATION_PER_MILLE else "train"


def _stdlib_files(root: pathlib.Path) -> list[tuple[str, bytes]]:
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if not _EXCLUDED_DIRS & set(relative.parts) and path.is_file():
            files.append((relative.as_posix(), path.read_bytes()))
    return files


def _archive_files(archive: pathlib.Path) -> tuple[list[tuple[str, bytes]], dict]:
    with tarfile.open(archive, "r:gz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    info = json.loads(members.pop(INFO_MEMBER))
    return sorted(members.items()), info


def load_corpus(source: pathlib.Path | None = None) -> Corpus:
    """Reads every `*.py` file (sorted by path) of `source` (default: this interpreter's stdlib)."""
    if source is not None and source.is_file():
        files, info = _archive_files(source)
        version = info["python_version"]
    else:
        files = _stdlib_files(source or stdlib_root())
        version = ".".join(map(str, sys.version_info[:3]))
    splits, num_skipped = {"train": [], "validation": [], "held_out": []}, 0
    for path, data in files:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        if not text.strip():
            num_skipped += 1
            continue
        splits[split_of(path)].append(Document(path, text))
    return Corpus(str(source or stdlib_root()), version, num_skipped=num_skipped, **splits)


def pack_corpus(archive: pathlib.Path, root: pathlib.Path | None = None) -> None:
    """Writes the stdlib's `*.py` files (paths relative to the root) and their Python version to a tar.gz."""
    root = root or stdlib_root()
    info = {"python_version": ".".join(map(str, sys.version_info[:3])), "root": str(root)}
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in [(INFO_MEMBER, json.dumps(info).encode())] + _stdlib_files(root):
            member = tarfile.TarInfo(name)
            member.size, member.mtime, member.mode = len(data), 0, 0o644
            tar.addfile(member, io.BytesIO(data))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Pack this interpreter's stdlib sources as a corpus archive.")
    parser.add_argument("--pack", type=pathlib.Path, required=True, help="archive to write (.tar.gz)")
    args = parser.parse_args()
    pack_corpus(args.pack)
    print(json.dumps(load_corpus(args.pack).summary()))
