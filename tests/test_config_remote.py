"""The ``remote_*`` keys: checked at start-up, errors name the key, a password never shows."""

from __future__ import annotations

import pytest

from tieredkv.config import ConfigError, MiB, TieredKVConfig

SECRET = "s3cr3t-Pa55"


def test_remote_tier_is_off_without_remote_url():
    config = TieredKVConfig.from_dict({})
    assert config.remote_url is None and not config.has_remote


def test_remote_keys_parse_with_their_defaults():
    config = TieredKVConfig.from_dict({"remote_url": "redis://cache.internal:6380/2"})
    assert config.has_remote
    assert config.remote_url is not None
    assert (config.remote_url.host, config.remote_url.port, config.remote_url.db) == ("cache.internal", 6380, 2)
    assert (config.remote_key_prefix, config.remote_timeout_s, config.remote_ttl_s) == ("tkv", 0.5, 0.0)
    assert config.remote_writes is True and config.remote_admission == 1
    assert config.remote_write_queue_bytes == 256 * MiB


def test_every_remote_key_is_read():
    config = TieredKVConfig.from_dict({
        "remote_url": ["redis://h1:7000", "redis://h2:7001"],
        "remote_key_prefix": "team-a",
        "remote_timeout_s": 0.25,
        "remote_ttl_s": 3600,
        "remote_writes": "false",
        "remote_admission": 2,
        "remote_write_queue_bytes": "64MiB",
    })
    assert config.remote_url is not None and config.remote_url.cluster
    assert config.remote_url.nodes == (("h1", 7000), ("h2", 7001))
    assert config.remote_key_prefix == "team-a"
    assert (config.remote_timeout_s, config.remote_ttl_s) == (0.25, 3600.0)
    assert config.remote_writes is False and config.remote_admission == 2
    assert config.remote_write_queue_bytes == 64 * MiB


def test_password_from_an_environment_variable(monkeypatch):
    monkeypatch.setenv("TKV_REDIS_PW", SECRET)
    config = TieredKVConfig.from_dict(
        {"remote_url": "rediss://app@redis.internal", "remote_password_env": "TKV_REDIS_PW"}
    )
    assert config.remote_url is not None and config.remote_url.password == SECRET
    assert config.remote_url.tls
    assert SECRET not in repr(config) and SECRET not in str(config)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"remote_timeout_s": 1.0}, "remote_timeout_s"),  # no remote_url
        ({"remote_url": "http://h"}, "remote_url"),
        ({"remote_url": "redis://h:99999"}, "remote_url"),
        ({"remote_url": 42}, "remote_url"),
        ({"remote_url": "redis://h", "remote_timeout_s": 0}, "remote_timeout_s"),
        ({"remote_url": "redis://h", "remote_timeout_s": float("nan")}, "remote_timeout_s"),
        ({"remote_url": "redis://h", "remote_timeout_s": 61}, "remote_timeout_s"),
        ({"remote_url": "redis://h", "remote_ttl_s": -1}, "remote_ttl_s"),
        ({"remote_url": "redis://h", "remote_key_prefix": "a:b"}, "remote_key_prefix"),
        ({"remote_url": "redis://h", "remote_key_prefix": "{x}"}, "remote_key_prefix"),
        ({"remote_url": "redis://h", "remote_key_prefix": ""}, "remote_key_prefix"),
        # Glob characters would let `tieredkv remote --purge` reach other prefixes' keys.
        ({"remote_url": "redis://h", "remote_key_prefix": "team?"}, "remote_key_prefix"),
        ({"remote_url": "redis://h", "remote_key_prefix": "t[e]am"}, "remote_key_prefix"),
        ({"remote_url": "redis://h", "remote_key_prefix": "team*"}, "remote_key_prefix"),
        ({"remote_url": "redis://h", "remote_key_prefix": "te\\am"}, "remote_key_prefix"),
        # Keys are ASCII: a non-ASCII prefix once failed at engine start (UnicodeEncodeError).
        ({"remote_url": "redis://h", "remote_key_prefix": "tkv\u00e9"}, "remote_key_prefix"),
        ({"remote_url": "redis://h", "remote_key_prefix": "\uff54kv"}, "remote_key_prefix"),
        ({"remote_url": "redis://h", "remote_key_prefix": "x" * 65}, "remote_key_prefix"),
        ({"remote_url": "redis://h", "remote_key_prefix": 7}, "remote_key_prefix"),
        ({"remote_url": "redis://h", "remote_url_password_ok": "maybe"}, "remote_url_password_ok"),
        ({"remote_url_password_ok": True}, "remote_url_password_ok"),  # no remote_url
        ({"remote_url": "redis://h", "remote_writes": "maybe"}, "remote_writes"),
        ({"remote_url": "redis://h", "remote_admission": 0}, "remote_admission"),
        ({"remote_url": "redis://h", "remote_write_queue_bytes": "1KiB"}, "remote_write_queue_bytes"),
        ({"remote_url": "redis://h", "remote_password_env": "NOT A NAME"}, "remote_url"),
        ({"remote_url": "redis://h", "remote_password_env": 5}, "remote_password_env"),
        ({"remote_url": "redis://h", "remote_password_env": "TKV_UNSET_VARIABLE_X"}, "remote_url"),
        ({"remote_url": "redis://h", "remote_bogus": 1}, "remote_bogus"),
    ],
)
def test_bad_remote_settings_fail_naming_the_key(extra, key):
    with pytest.raises(ConfigError) as err:
        TieredKVConfig.from_dict(extra)
    assert err.value.key == key
    assert str(err.value).startswith(f"tieredkv: invalid {key}: ")


@pytest.mark.parametrize(
    "url",
    [f"redis://:{SECRET}@h:1/x", f"redis+cluster://u:{SECRET}@h1:1/3", f"redis://:{SECRET}@h:1?tls=1",
     [f"redis://:{SECRET}@h1:1", "rediss://h2:2"]],
)
def test_a_bad_url_never_echoes_its_password(url):
    with pytest.raises(ConfigError) as err:
        TieredKVConfig.from_dict({"remote_url": url})
    assert err.value.key == "remote_url"
    assert SECRET not in str(err.value) and SECRET not in repr(err.value.value)


@pytest.mark.parametrize(
    "url",
    [f"redis://:{SECRET}@cache-host-q", f"rediss://app:{SECRET}@cache-host-q:6380/1",
     [f"redis+cluster://:{SECRET}@cache-host-q:1", f"redis://:{SECRET}@cache-host-r:2"]],
)
def test_a_password_in_the_url_is_refused_unless_allowed(url):
    """vLLM logs kv_connector_extra_config verbatim at start-up ("non-default args"): a
    password inside remote_url would land in the server log."""
    with pytest.raises(ConfigError) as err:
        TieredKVConfig.from_dict({"remote_url": url})
    message = str(err.value)
    assert err.value.key == "remote_url"
    assert "remote_password_env" in message and "remote_url_password_ok" in message
    assert SECRET not in message and "cache-host" not in message  # neither password nor URL
    allowed = TieredKVConfig.from_dict({"remote_url": url, "remote_url_password_ok": "true"})
    assert allowed.remote_url is not None and allowed.remote_url.password == SECRET
    assert allowed.remote_url_password_ok is True and SECRET not in repr(allowed)


def test_a_user_name_without_a_password_needs_no_opt_in():
    config = TieredKVConfig.from_dict({"remote_url": "redis://app@h:1"})
    assert config.remote_url is not None and config.remote_url.username == "app"
    assert config.remote_url.password is None and config.remote_url_password_ok is False


def test_a_password_given_twice_is_refused_without_showing_either(monkeypatch):
    monkeypatch.setenv("TKV_REDIS_PW", "other-" + SECRET)
    with pytest.raises(ConfigError, match="both in the URL") as err:
        TieredKVConfig.from_dict(
            {"remote_url": f"redis://:{SECRET}@h", "remote_password_env": "TKV_REDIS_PW",
             "remote_url_password_ok": True}
        )
    assert SECRET not in str(err.value)
