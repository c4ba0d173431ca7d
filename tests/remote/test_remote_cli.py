"""``tieredkv remote``: what a shared tier holds, by namespace and rank, and purging it."""

from __future__ import annotations

import hashlib
import json

import pytest

from tieredkv.cli import main
from tieredkv.remote.codec import encode, remote_key
from tieredkv.remote_url import parse_remote_url
from tieredkv.tools.remote_admin import connect, purge, report

NS_A = hashlib.sha256(b"engine a").digest()
NS_B = hashlib.sha256(b"engine b").digest()


def _fill(url: str, prefix: str) -> None:
    client = connect(parse_remote_url(url))
    for i in range(6):
        key = hashlib.sha256(f"chunk {i}".encode()).digest()
        for ns, ranks in ((NS_A, 2), (NS_B, 1)):
            for rank in range(ranks):
                value = encode(b"\x07" * 100, fingerprint=ns, key=key, rank=rank)
                client.set(remote_key(ns, rank, key, prefix), value)
    client.set(f"{prefix}:not-a-shard", b"x")


def test_report_counts_keys_by_namespace_and_rank(deployment, prefix, capsys):
    _fill(deployment, prefix)
    assert main(["remote", deployment, "--prefix", prefix, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    a, b = NS_A.hex()[:16], NS_B.hex()[:16]
    assert found["namespaces"] == {a: {"r0": 6, "r1": 6}, b: {"r0": 6}}
    assert found["keys"] == 18 and found["other_keys"] == 1
    assert found["value_bytes"] == 18 * (100 + 100)  # header + payload
    assert found["server"]["used_memory"] > 0


def test_purge_one_namespace_then_all(deployment, prefix, capsys):
    _fill(deployment, prefix)
    a, b = NS_A.hex()[:16], NS_B.hex()[:16]
    assert main(["remote", deployment, "--prefix", prefix, "--purge", "--namespace", b]) == 0
    assert "deleted 6 keys" in capsys.readouterr().out
    main(["remote", deployment, "--prefix", prefix, "--json"])
    assert json.loads(capsys.readouterr().out)["namespaces"] == {a: {"r0": 6, "r1": 6}}
    assert main(["remote", deployment, "--prefix", prefix, "--purge"]) == 0
    assert "deleted 12 keys" in capsys.readouterr().out
    main(["remote", deployment, "--prefix", prefix, "--json"])
    found = json.loads(capsys.readouterr().out)
    assert found["keys"] == 0 and found["other_keys"] == 1  # never touches other keys


def test_errors_are_usage_errors_without_the_password(fresh_server, capsys):
    server = fresh_server(start=False)
    with pytest.raises(SystemExit) as exited:
        main(["remote", f"redis://:hunter2-secret@127.0.0.1:{server.port}/0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "hunter2-secret" not in err and "***" in err
    with pytest.raises(SystemExit) as exited:
        main(["remote", "http://nope"])
    assert exited.value.code == 2
    with pytest.raises(SystemExit):
        main(["remote", "redis://h", "--namespace", "abc"])


# ------------------------------------------------- prefixes are matched literally (issue 23)

NS_A16, NS_B16 = NS_A.hex()[:16], NS_B.hex()[:16]


def _plant(client, prefix: str, count: int = 3) -> None:
    """Shard-named keys under ``prefix``, written raw: the codec refuses glob prefixes now."""
    for i in range(count):
        chunk = hashlib.sha256(f"{prefix} chunk {i}".encode()).hexdigest()
        for ns in (NS_A16, NS_B16):
            client.set(f"{prefix}:{ns}:r0:{{{chunk}}}".encode(), b"v")


def _shards(client, prefix: str) -> int:
    return report(client, prefix, sizes=False).as_dict()["keys"]


def test_a_glob_prefix_is_refused_and_purges_nothing(deployment, prefix, capsys):
    """`--purge --prefix team?` once deleted teamA's and teamB's keys."""
    client = connect(parse_remote_url(deployment))
    for team in (f"{prefix}A", f"{prefix}B", prefix):
        _plant(client, team)
    for bad in (f"{prefix}?", f"{prefix}*", f"{prefix}[AB]", f"{prefix}\\A", f"{prefix}\u00e9"):
        with pytest.raises(SystemExit) as exited:
            main(["remote", deployment, "--prefix", bad, "--purge"])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "--prefix" in err and "glob characters" in err and "ASCII" in err
    assert [_shards(client, t) for t in (f"{prefix}A", f"{prefix}B", prefix)] == [6, 6, 6]
    assert main(["remote", deployment, "--prefix", f"{prefix}A", "--purge"]) == 0
    assert "deleted 6 keys" in capsys.readouterr().out
    assert [_shards(client, t) for t in (f"{prefix}A", f"{prefix}B", prefix)] == [0, 6, 6]


def test_purge_matches_its_prefix_literally(deployment, prefix):
    """Escaped in SCAN MATCH even where the CLI's check is bypassed: `t[e]am` deleted nothing
    of its own (and would have deleted `team`'s keys); `team?` reached teamA and teamB."""
    client = connect(parse_remote_url(deployment))
    brackets, plain = f"{prefix}[x]", f"{prefix}x"
    for team in (brackets, plain, f"{prefix}A", f"{prefix}B"):
        _plant(client, team)
    assert purge(client, f"{prefix}?") == 0
    assert report(client, f"{prefix}?").as_dict()["keys"] == 0
    assert purge(client, brackets) == 6  # exactly its own
    assert [_shards(client, t) for t in (brackets, plain, f"{prefix}A", f"{prefix}B")] == [0, 6, 6, 6]


def test_purge_checks_each_keys_prefix_and_namespace(deployment, prefix, capsys):
    client = connect(parse_remote_url(deployment))
    _plant(client, prefix)
    # "P:NS" as a prefix matches P's keys of namespace NS by pattern, but they are not its keys.
    assert purge(client, f"{prefix}:{NS_A16}") == 0
    assert purge(client, prefix, NS_B16) == 3 and _shards(client, prefix) == 3
    with pytest.raises(ValueError, match="16 lowercase hex"):
        purge(client, prefix, "*")
    with pytest.raises(SystemExit) as exited:
        main(["remote", deployment, "--prefix", prefix, "--purge", "--namespace", "*"])
    assert exited.value.code == 2 and "16 lowercase hex" in capsys.readouterr().err
    assert _shards(client, prefix) == 3
