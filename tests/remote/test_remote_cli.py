"""``tieredkv remote``: what a shared tier holds, by namespace and rank, and purging it."""

from __future__ import annotations

import hashlib
import json

import pytest

from tieredkv.cli import main
from tieredkv.remote.codec import encode, remote_key
from tieredkv.remote_url import parse_remote_url
from tieredkv.tools.remote_admin import connect

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
