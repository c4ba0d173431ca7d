"""``remote_url`` parsing: every accepted form, clear errors, and a password that never shows."""

from __future__ import annotations

import logging

import pytest

from tieredkv.remote_url import DEFAULT_PORT, RemoteURL, parse_remote_url

SECRET = "p@ss/w?rd#S3CRET"


def test_single_node_defaults() -> None:
    url = parse_remote_url("redis://cache.internal")
    assert url == RemoteURL(nodes=(("cache.internal", DEFAULT_PORT),))
    assert (url.cluster, url.tls, url.db, url.username, url.password) == (False, False, 0, None, None)
    assert url.redacted() == "redis://cache.internal:6379/0"


def test_single_node_full() -> None:
    url = parse_remote_url("rediss://alice:" + SECRET + "@10.0.0.5:6380/3")
    assert url.tls and not url.cluster
    assert (url.host, url.port, url.db, url.username, url.password) == ("10.0.0.5", 6380, 3, "alice", SECRET)
    assert url.redacted() == "rediss://alice:***@10.0.0.5:6380/3"


def test_percent_encoded_password_and_ipv6() -> None:
    url = parse_remote_url("redis://:a%3Ab%40c@[::1]:7000")
    assert url.password == "a:b@c" and url.username is None
    assert url.nodes == (("::1", 7000),)
    assert url.redacted() == "redis://:***@[::1]:7000/0"


def test_cluster_seed_string() -> None:
    url = parse_remote_url("redis+cluster://:pw@h1:7000,h2:7001,h1:7000")
    assert url.cluster and not url.tls
    assert url.nodes == (("h1", 7000), ("h2", 7001))  # duplicates folded
    assert url.redacted() == "redis+cluster://:***@h1:7000,h2:7001"


def test_cluster_seed_list_tls() -> None:
    url = parse_remote_url(["rediss://:pw@h1:7000", "rediss://:pw@h2"])
    assert url.cluster and url.tls and url.password == "pw"
    assert url.nodes == (("h1", 7000), ("h2", DEFAULT_PORT))
    assert url.scheme == "rediss+cluster"


def test_password_from_env() -> None:
    url = parse_remote_url("redis://bob@h:1", password_env="TKV_PW", environ={"TKV_PW": SECRET})
    assert (url.username, url.password) == ("bob", SECRET)
    assert SECRET not in repr(url) and SECRET not in str(url) and SECRET not in url.redacted()


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("", "expected"),
        ("localhost:6379", "unknown scheme"),
        ("http://h:1", "unknown scheme"),
        ("unix:///tmp/redis.sock", "unix sockets"),
        ("redis://", "missing host"),
        ("redis://:" + SECRET + "@", "missing host"),
        ("redis://h:0", "bad port"),
        ("redis://h:65536", "bad port"),
        ("redis://h:abc", "bad port"),
        ("redis://h:", "empty port"),
        ("redis://h/x", "database must be a number"),
        ("redis://h/1/2", "database must be a number"),
        ("redis://h1,h2", "+cluster"),
        ("redis+cluster://h1:1,h2:2/1", "only database 0"),
        ("redis://h?ssl_cert_reqs=none", "query strings"),
        ("redis://[::1:1", "unclosed"),
        ("redis://bad host", "bad host"),
        ([], "non-empty list"),
        (["redis://h1", "rediss://h2"], "mix TLS"),
        (["redis://:a@h1", "redis://:b@h2"], "different credentials"),
        (["redis://h1/2"], "only database 0"),
        (6379, "expected"),
    ],
)
def test_bad_url_names_the_setting(value: object, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_remote_url(value)  # type: ignore[arg-type]
    message = str(err.value)
    assert message.startswith("remote_url: ")
    assert needle in message
    assert SECRET not in message


def test_password_env_errors() -> None:
    with pytest.raises(ValueError, match="remote_url: the environment variable named by "
                       "remote_password_env is not set") as err:
        parse_remote_url("redis://h", password_env="TKV_MISSING", environ={})
    assert "TKV_MISSING" not in str(err.value)  # it may be a password typed in the wrong key
    with pytest.raises(ValueError, match="remote_url: a password is given both"):
        parse_remote_url("redis://:x@h", password_env="TKV_PW", environ={"TKV_PW": "y"})
    with pytest.raises(ValueError, match="remote_url: remote_password_env must be"):
        parse_remote_url("redis://h", password_env="not a name", environ={})


def test_password_absent_from_repr_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    url = parse_remote_url(f"redis://u:{SECRET}@h:1/2")
    caplog.set_level(logging.DEBUG)
    logging.getLogger("tieredkv.test").warning("connecting to %s / %r / %s", url, url, [url])
    text = caplog.text + repr(url) + str(url) + f"{url!r}"
    assert SECRET not in text and "***" in text
    assert url.scrub(f"auth failed for {SECRET} (a%3Ab)") == "auth failed for *** (a%3Ab)"
