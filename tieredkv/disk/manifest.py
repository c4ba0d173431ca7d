"""``<disk_path>/manifest.json``: what a disk tier was built for.

The journal only says which key sits in which slot; it means something only for the same
namespace and the same slot geometry. The manifest records those, so that a restart with a
different model, dtype, chunk size or TP size starts empty instead of trusting slots laid out
for another engine. Plain JSON (readable by people and by ``tieredkv inspect``), written
atomically, never pickled. Written once at start-up from synchronous code, so plain ``os``
calls rather than aiofiles (which would need an event loop just for this). Every open goes
through :mod:`tieredkv.disk.private_files`: a link planted at ``manifest.json`` is refused
(:class:`~tieredkv.disk.private_files.UntrustedPathError`), one planted at the temporary
file is removed, never followed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tieredkv.disk.format import FORMAT_VERSION, manifest_path
from tieredkv.disk.private_files import UntrustedPathError, create_private_exclusive, open_private

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Manifest:
    format_version: int
    fingerprint: str  # hex of the 32-byte namespace fingerprint
    payload_bytes: int
    slot_stride: int
    num_slots: int
    world_size: int
    created: float

    @classmethod
    def new(
        cls, fingerprint: bytes, payload_bytes: int, slot_stride: int, num_slots: int,
        world_size: int, created: float | None = None,
    ) -> Manifest:
        return cls(
            FORMAT_VERSION, fingerprint.hex(), payload_bytes, slot_stride, num_slots, world_size,
            time.time() if created is None else created,
        )

    def mismatch(
        self, fingerprint: bytes, payload_bytes: int, slot_stride: int, world_size: int
    ) -> str | None:
        """Why this disk tier's contents cannot serve the given engine, or None if they can.

        ``num_slots`` is deliberately not compared: capacity may change between runs.
        """
        if self.format_version != FORMAT_VERSION:
            return f"format version {self.format_version} != {FORMAT_VERSION}"
        if self.fingerprint != fingerprint.hex():
            return f"namespace fingerprint {self.fingerprint[:16]}... != {fingerprint.hex()[:16]}..."
        if self.payload_bytes != payload_bytes:
            return f"payload_bytes {self.payload_bytes} != {payload_bytes}"
        if self.slot_stride != slot_stride:
            return f"slot stride {self.slot_stride} != {slot_stride}"
        if self.world_size != world_size:
            return f"world size {self.world_size} != {world_size}"
        return None


def _file(path: Path) -> Path:
    path = Path(path)
    return manifest_path(path) if path.is_dir() else path


def load_manifest(path: Path) -> Manifest | None:
    """Read the manifest of a disk tier (``path``: the directory or the file itself).

    Returns None, with a warning, when it is missing, unparseable or incomplete: the caller
    then treats the disk tier as empty, which is always safe. Raises
    :class:`~tieredkv.disk.private_files.UntrustedPathError` (never read as "unreadable")
    when the file is a symlink or not our own regular file.
    """
    file = _file(path)
    try:
        raw = json.loads(_read(file).decode("utf-8"))
        manifest = Manifest(
            format_version=int(raw["format_version"]),
            fingerprint=str(raw["fingerprint"]),
            payload_bytes=int(raw["payload_bytes"]),
            slot_stride=int(raw["slot_stride"]),
            num_slots=int(raw["num_slots"]),
            world_size=int(raw["world_size"]),
            created=float(raw["created"]),
        )
    except FileNotFoundError:
        logger.warning("tieredkv disk tier: no manifest at %s", file)
        return None
    except UntrustedPathError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("tieredkv disk tier: unreadable manifest %s: %s", file, exc)
        return None
    return manifest


def _read(file: Path) -> bytes:
    """The file's bytes, read without following a link; ``O_NONBLOCK``: a FIFO never blocks."""
    fd = open_private(file, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb", closefd=True) as stream:
        return stream.read()


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write the manifest atomically (temp file, fsync, rename, fsync of the directory), 0600.

    The temporary file is created ``O_EXCL`` after unlinking whatever had its name, and the
    rename replaces a link at ``manifest.json`` itself, so no write follows a planted link.
    """
    file = _file(path)
    tmp = file.with_name(file.name + ".tmp")
    data = (json.dumps(asdict(manifest), indent=2, sort_keys=True) + "\n").encode()
    fd = create_private_exclusive(tmp, os.O_WRONLY | os.O_NONBLOCK, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, file)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dir_fd = os.open(file.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
