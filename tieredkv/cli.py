"""The ``tieredkv`` command: look inside a tier without starting an engine.

``tieredkv inspect PATH`` says what a disk tier holds; ``tieredkv verify PATH [--drop]`` reads
every journaled slot on every rank and checks it byte for byte; ``tieredkv remote URL
[--purge]`` counts (or deletes) a shared Redis tier's keys by namespace and rank. Exit codes: 0 all good,
1 bad slots found, 2 usage errors (with a message naming the problem). The directory must be
one an engine would accept (owned by this user, not writable by group or others) and no file
in it is opened through a symlink; otherwise the command stops with exit code 2. Neither
command takes the engine's lock to look at it: ``inspect`` can run beside a starting engine.

Subcommands register themselves with :func:`subcommand`; adding one is three lines::

    @subcommand("demo", "run a small demo", configure=lambda p: p.add_argument("--model"))
    def _demo(args: argparse.Namespace) -> int:
        return run_demo(args)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tieredkv.config import ConfigError
from tieredkv.disk.catalog import Manifest, load_manifest
from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import MANIFEST_NAME, journal_path, manifest_path, slab_files, slab_path
from tieredkv.disk.journal import Journal
from tieredkv.disk.private_files import DiskLock, UntrustedPathError, ensure_private_dir
from tieredkv.disk.slab import SlabFile
from tieredkv.protocol import FailureCause

EXIT_OK = 0
EXIT_BAD = 1
EXIT_USAGE = 2
class UsageError(Exception):
    """Bad input from the user: printed as ``tieredkv: error: ...`` with exit code 2."""


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    configure: Callable[[argparse.ArgumentParser], Any] | None = None


SUBCOMMANDS: dict[str, Subcommand] = {}


def subcommand(
    name: str, help: str, configure: Callable[[argparse.ArgumentParser], Any] | None = None
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Register ``fn(args) -> exit code`` as ``tieredkv NAME``; ``configure`` adds its args."""

    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        SUBCOMMANDS[name] = Subcommand(name, help, fn, configure)
        return fn

    return register


# -- helpers ------------------------------------------------------------------------------


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _disk_dir(path: str) -> Path:
    disk = Path(path).expanduser()
    if not disk.exists():
        raise UsageError(f"{disk}: no such directory")
    if not disk.is_dir():
        raise UsageError(f"{disk}: not a directory")
    ensure_private_dir(disk)  # exists, so only checked: a symlink or a shared directory is refused
    return disk


def _require_manifest(disk: Path) -> Manifest:
    manifest = load_manifest(disk) if os.path.lexists(manifest_path(disk)) else None
    if manifest is None:
        raise UsageError(
            f"{disk}: no readable {MANIFEST_NAME}; not a tieredkv disk tier, or its manifest is "
            "damaged (an engine starting on it will reset it)"
        )
    return manifest


def _print_json(data: dict[str, Any]) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


# -- inspect ------------------------------------------------------------------------------


def _inspect_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="the disk tier directory (disk_path)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


@subcommand("inspect", "show what a disk tier holds", configure=_inspect_args)
def inspect_cmd(args: argparse.Namespace) -> int:
    disk = _disk_dir(args.path)
    has_manifest = os.path.lexists(manifest_path(disk))
    manifest = load_manifest(disk) if has_manifest else None
    files = slab_files(disk)
    if manifest is None and not files and not os.path.lexists(journal_path(disk)):
        raise UsageError(f"{disk}: not a tieredkv disk tier (no manifest, journal or slab files)")
    replay = Journal.replay(journal_path(disk))
    holder = DiskLock.holder(disk)
    slabs = []
    for file in files:
        st = file.lstat()  # a link is not followed even to size it (SlabFile.open refuses one)
        slabs.append({"file": file.name, "bytes": st.st_size, "allocated": st.st_blocks * 512})
    info: dict[str, Any] = {
        "path": str(disk),
        "manifest": asdict(manifest) if manifest is not None else None,
        "manifest_status": "ok" if manifest else ("unreadable" if has_manifest else "missing"),
        "journal": {
            "entries": len(replay.entries),
            "records": replay.records,
            "bad_tail_bytes": replay.bad_tail_bytes,
        },
        "slab_files": slabs,
        "lock_holder_pid": holder,
    }
    if manifest is not None:
        used = len(replay.entries)
        info["slots_used"] = used
        info["slots_capacity"] = manifest.num_slots
        info["payload_bytes_used"] = used * manifest.payload_bytes * manifest.world_size
        info["payload_bytes_capacity"] = (
            manifest.num_slots * manifest.payload_bytes * manifest.world_size
        )
    if args.json:
        _print_json(info)
        return EXIT_OK
    lines = [("disk tier", str(disk))]
    if manifest is not None:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created))
        lines += [
            ("namespace", manifest.fingerprint),
            ("format", f"version {manifest.format_version}, created {created}"),
            ("geometry", f"payload {manifest.payload_bytes} B, slot stride {manifest.slot_stride} B, "
                         f"{manifest.num_slots} slots per rank, world size {manifest.world_size}"),
        ]
    else:
        lines.append(("manifest", f"{info['manifest_status']} (an engine will start this tier empty)"))
    tail = f", {replay.bad_tail_bytes} bytes of torn/corrupt tail" if replay.bad_tail_bytes else ""
    lines.append(("journal", f"{len(replay.entries)} entries ({replay.records} records{tail})"))
    if manifest is not None:
        pct = 100.0 * info["slots_used"] / manifest.num_slots if manifest.num_slots else 0.0
        lines.append(("slots used", f"{info['slots_used']} / {manifest.num_slots} ({pct:.1f}%)"))
        lines.append(("bytes used", f"{_size(info['payload_bytes_used'])} of "
                                    f"{_size(info['payload_bytes_capacity'])} (all ranks)"))
    for slab in slabs:
        lines.append((slab["file"], f"{_size(slab['bytes'])} (allocated {_size(slab['allocated'])})"))
    if holder is None:
        lines.append(("lock", "free"))
    else:
        lines.append(("lock", f"held by pid {holder}" if holder > 0 else "held (pid unknown)"))
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    return EXIT_OK


# -- verify -------------------------------------------------------------------------------


def _verify_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="the disk tier directory (disk_path)")
    parser.add_argument(
        "--drop", action="store_true",
        help="invalidate bad slots and journal their removal (needs the engine stopped)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


@subcommand("verify", "read and checksum every journaled slot on every rank", configure=_verify_args)
def verify_cmd(args: argparse.Namespace) -> int:
    disk = _disk_dir(args.path)
    manifest = _require_manifest(disk)
    lock: DiskLock | None = None
    if args.drop:
        try:
            lock = DiskLock(disk)
        except ConfigError as exc:
            raise UsageError(f"--drop needs the disk tier to be free: {exc}") from None
    try:
        return _verify(disk, manifest, args, lock)
    finally:
        if lock is not None:
            lock.close()


def _verify(disk: Path, manifest: Manifest, args: argparse.Namespace, lock: DiskLock | None) -> int:
    fingerprint = bytes.fromhex(manifest.fingerprint)
    entries = Journal.replay(journal_path(disk)).entries
    bad: dict[bytes, tuple[int, int, SlabError]] = {}  # key -> (slot, rank, first failure)
    out = bytearray(manifest.payload_bytes)
    for rank in range(manifest.world_size):
        todo = sorted(((slot, key) for key, slot in entries.items() if key not in bad))
        try:
            slab = SlabFile.open(
                slab_path(disk, rank), manifest.num_slots, manifest.payload_bytes, fingerprint,
                direct=False, create=False, readonly=True,
            )
        except SlabError as exc:
            for slot, key in todo:
                bad[key] = (slot, rank, exc)
            continue
        with slab:
            for slot, key in todo:
                if slot >= manifest.num_slots:
                    bad[key] = (slot, rank, SlabError(FailureCause.MISSING, "slot beyond num_slots"))
                    continue
                try:
                    slab.read_slot_into(slot, key, out)
                except SlabError as exc:
                    bad[key] = (slot, rank, exc)
    counts = Counter(err.kind.value for _, _, err in bad.values())
    dropped = _drop(disk, manifest, fingerprint, bad) if lock is not None and bad else 0
    holder = DiskLock.holder(disk) if lock is None else None
    report = {
        "path": str(disk),
        "entries": len(entries),
        "good": len(entries) - len(bad),
        "bad": dict(counts),
        "bad_keys": [
            {"key": key.hex(), "slot": slot, "rank": rank, "kind": err.kind.value, "error": str(err)}
            for key, (slot, rank, err) in sorted(bad.items(), key=lambda kv: kv[1][0])
        ],
        "dropped": dropped,
        "engine_running_pid": holder,
    }
    if args.json:
        _print_json(report)
    else:
        if holder is not None:
            print(f"note: an engine (pid {holder}) is using this tier; slots it is writing right "
                  "now may show up as bad")
        print(f"{disk}: {len(entries)} journaled entries x {manifest.world_size} rank(s): "
              f"{report['good']} good, {len(bad)} bad")
        for kind, count in sorted(counts.items()):
            print(f"  {kind}: {count}")
        for item in report["bad_keys"]:
            print(f"  bad: key {item['key']} slot {item['slot']} rank {item['rank']}: {item['kind']}")
        if dropped:
            print(f"dropped {dropped} bad entries (slots invalidated, removal journaled)")
        elif bad:
            print("run again with --drop (engine stopped) to invalidate them")
    return EXIT_BAD if bad else EXIT_OK


def _drop(disk: Path, manifest: Manifest, fingerprint: bytes,
          bad: dict[bytes, tuple[int, int, SlabError]]) -> int:
    """Zero the bad slots' headers on every rank and journal their removal; returns the count."""
    for rank in range(manifest.world_size):
        try:
            slab = SlabFile.open(
                slab_path(disk, rank), manifest.num_slots, manifest.payload_bytes, fingerprint,
                direct=False, create=False,
            )
        except SlabError:
            continue  # nothing there to invalidate
        with slab:
            for slot, _, _ in bad.values():
                if slot < manifest.num_slots:
                    try:
                        slab.invalidate_slot(slot)
                    except SlabError as exc:
                        print(f"warning: could not invalidate slot {slot} on rank {rank}: {exc}",
                              file=sys.stderr)
            slab.sync()
    with Journal(journal_path(disk)) as journal:
        for key in bad:
            journal.record_remove(key)
        journal.flush()
    return len(bad)


# -- entry point --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tieredkv", description="Inspect and check tieredkv KV-cache tiers."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in SUBCOMMANDS.values():
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        if command.configure is not None:
            command.configure(sub)
        sub.set_defaults(_run=command.run)
    return parser


def _demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=Path, default=Path(".tieredkv-demo"),
                        help="where the model, disk tier and server logs go")
    parser.add_argument("--users", type=int, default=3, help="concurrent conversations")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")


@subcommand("demo", "serve long multi-turn prompts through vLLM + tieredkv and print TTFT", configure=_demo_args)
def demo_cmd(args: argparse.Namespace) -> int:
    from tieredkv.tools.demo import run_demo

    return run_demo(args.workdir, users=args.users, turns=args.turns)


def _remote_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the engines' remote_url (redis://, rediss://, redis+cluster://)")
    parser.add_argument("--password-env", help="environment variable holding the password")
    parser.add_argument("--prefix", default="tkv",
                        help="the engines' remote_key_prefix (matched literally; glob characters are refused)")
    parser.add_argument("--purge", action="store_true",
                        help="delete the tieredkv keys under the prefix (other replicas lose them)")
    parser.add_argument("--namespace", help="with --purge: only this namespace (16 hex digits)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


@subcommand("remote", "show what a shared Redis tier holds, or purge it", configure=_remote_args)
def remote_cmd(args: argparse.Namespace) -> int:
    from tieredkv.remote_url import check_prefix, parse_remote_url
    from tieredkv.tools.remote_admin import NAMESPACE, connect, purge, report

    try:
        url = parse_remote_url(args.url, password_env=args.password_env)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        prefix = check_prefix(args.prefix)
    except ValueError as exc:
        raise UsageError(f"--prefix: {exc}") from None
    if args.namespace and not args.purge:
        raise UsageError("--namespace only goes with --purge")
    if args.namespace is not None and not NAMESPACE.fullmatch(args.namespace):
        raise UsageError("--namespace: expected 16 lowercase hex digits, as each engine logs its "
                         "namespace fingerprint")
    try:
        client = connect(url)
        if args.purge:
            deleted = purge(client, prefix, args.namespace)
            print(f"deleted {deleted} keys under {prefix}:"
                  + (f"{args.namespace}:" if args.namespace else ""))
            return EXIT_OK
        found = report(client, prefix).as_dict()
    except Exception as exc:  # noqa: BLE001 - any client error: say it, never the password
        raise UsageError(f"{url.redacted()}: {url.scrub(str(exc))}") from None
    if args.json:
        print(json.dumps(found, indent=2))
        return EXIT_OK
    server = found["server"]
    print(f"{url.redacted()}: {found['keys']} tieredkv keys under {prefix}:, "
          f"{found['value_bytes']} value bytes; server uses {server['used_memory']} of "
          f"{server['maxmemory'] or 'unlimited'} bytes, evicted {server['evicted_keys']} keys")
    for ns, ranks in found["namespaces"].items():
        print(f"  namespace {ns}: " + ", ".join(f"{r} {n}" for r, n in ranks.items()))
    if found["other_keys"]:
        print(f"  {found['other_keys']} other keys under the prefix (not tieredkv shards)")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="tieredkv: %(levelname)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args))
    except UsageError as exc:
        parser.exit(EXIT_USAGE, f"tieredkv: error: {exc}\n")
    except UntrustedPathError as exc:
        message = str(exc).removeprefix("tieredkv: ")
        parser.exit(EXIT_USAGE, f"tieredkv: error: {message}\n")
    except BrokenPipeError:
        return EXIT_OK
    return EXIT_OK  # pragma: no cover - parser.exit raised


if __name__ == "__main__":
    sys.exit(main())
