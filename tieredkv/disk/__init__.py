"""The NVMe tier: self-verifying slab slots, their I/O, and the index that survives restarts.

Worker side: :class:`SlabFile` (one per rank), driven by the worker's slab I/O pool
(:class:`tieredkv.transfer.disk_jobs.SlabExecutor`). Scheduler
side: :class:`DiskCatalog` (lock, manifest, journal, verified recovery). File names and slot
geometry: :mod:`tieredkv.disk.format`. Every failure is a :class:`SlabError` with a
:class:`tieredkv.protocol.FailureCause`.
"""

from tieredkv.disk.catalog import DiskCatalog
from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import HEADER_BYTES, SlotHeader, aliases_kept, slab_path, slot_stride
from tieredkv.disk.private_files import FileIO
from tieredkv.disk.slab import SlabFile

__all__ = [
    "HEADER_BYTES",
    "DiskCatalog",
    "FileIO",
    "SlabError",
    "SlabFile",
    "SlotHeader",
    "aliases_kept",
    "slab_path",
    "slot_stride",
]
