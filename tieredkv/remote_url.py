"""Where the shared remote tier lives: the ``remote_url`` setting, parsed and checked once.

Accepted forms (``remote_url`` in ``kv_connector_extra_config``)::

    redis://[user[:password]@]host[:port][/db]        one node (db defaults to 0)
    rediss://...                                      the same over TLS
    redis+cluster://[user[:password]@]h1:p1,h2:p2     Redis Cluster, seed nodes (any subset
    rediss+cluster://...                              of the cluster: the rest is discovered)
    ["redis://h1:p1", "redis://h2:p2"]                a list always means Cluster seed nodes

The port defaults to 6379; IPv6 hosts are written in brackets (``[::1]:6379``). A Cluster has
only database 0. Query strings and fragments are refused rather than silently ignored: an
option that looks set but is not is worse than an error.

The password may sit in the URL (percent-encoded where needed) or, better, in an environment
variable whose *name* is given (``remote_password_env``), so that it never lands in a config
file, a command line or a log. It is never part of ``repr``/``str``: log :meth:`redacted`.
Error messages never quote the value or any piece of it (a mistyped URL may hold a password in
the wrong place, e.g. ``?password=...``): they say what is wrong and, for a list, which item.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

DEFAULT_PORT = 6379
SETTING = "remote_url"
PASSWORD_ENV_SETTING = "remote_password_env"
URL_PASSWORD_OK_SETTING = "remote_url_password_ok"
REDACTED = "***"
DEFAULT_KEY_PREFIX = "tkv"

# scheme -> (tls, cluster)
_SCHEMES: dict[str, tuple[bool, bool]] = {
    "redis": (False, False),
    "rediss": (True, False),
    "redis+cluster": (False, True),
    "rediss+cluster": (True, True),
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_HOST_NAME = re.compile(r"[A-Za-z0-9._-]+\Z")
# Hash-tag braces and the separator break the key format; glob characters would make the
# operator's SCAN MATCH (``tieredkv remote --purge``) reach other prefixes' keys.
_PREFIX_FORBIDDEN = frozenset("{}:*?[]\\")
PREFIX_MAX_CHARS = 64


@dataclass(frozen=True)
class RemoteURL:
    """A checked ``remote_url``: nodes, TLS, database and credentials.

    ``password`` is excluded from ``repr`` and from :meth:`redacted`; hand the object itself to
    the client factory, never a formatted string of it.
    """

    nodes: tuple[tuple[str, int], ...]
    cluster: bool = False
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def scheme(self) -> str:
        return ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")

    @property
    def host(self) -> str:
        """The first (for one node: the only) node's host."""
        return self.nodes[0][0]

    @property
    def port(self) -> int:
        return self.nodes[0][1]

    def redacted(self) -> str:
        """The URL with the password replaced by ``***``: the only form that may be logged."""
        auth = ""
        if self.username or self.password:
            auth = quote(self.username or "", safe="")
            if self.password:
                auth += ":" + REDACTED
            auth += "@"
        hosts = ",".join(_format_node(host, port) for host, port in self.nodes)
        path = "" if self.cluster else f"/{self.db}"
        return f"{self.scheme}://{auth}{hosts}{path}"

    def scrub(self, text: str) -> str:
        """``text`` (e.g. a client's exception message) with any copy of the password removed."""
        if self.password:
            for form in {self.password, quote(self.password, safe="")}:
                text = text.replace(form, REDACTED)
        return text

    def __str__(self) -> str:
        return self.redacted()

    def __repr__(self) -> str:
        return f"RemoteURL({self.redacted()!r})"


def _format_node(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _error(message: str) -> ValueError:
    """The error for a bad ``remote_url``: it describes the value, never quotes it."""
    return ValueError(f"{SETTING}: {message}")


def _parse_node(text: str) -> tuple[str, int]:
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise _error("unclosed '[' in an IPv6 host")
        host, rest = text[1:end], text[end + 1:]
        if rest and not rest.startswith(":"):
            raise _error("unexpected text after an IPv6 host (expected :PORT)")
        port_text = rest[1:] if rest else ""
        if not host or not all(c in "0123456789abcdefABCDEF:." for c in host):
            raise _error("bad IPv6 host (hex digits, ':' and '.' only)")
    else:
        host, colon, port_text = text.partition(":")
        if colon and not port_text:
            raise _error("empty port")
        if not host:
            raise _error("missing host")
        if not _HOST_NAME.match(host):
            raise _error("bad host (letters, digits, '.', '-' and '_' only)")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _error("bad port (expected 1..65535)")
    return host, int(port_text)


def _parse_one(raw: str) -> RemoteURL:
    if not isinstance(raw, str) or not raw.strip():
        raise _error("expected a redis://, rediss:// or redis+cluster:// URL")
    raw = raw.strip()
    scheme, sep, rest = raw.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in _SCHEMES:
        hint = " (unix sockets are not supported)" if scheme == "unix" else ""
        raise _error(
            f"unknown scheme{hint}; use redis://, rediss://, redis+cluster:// or rediss+cluster://",
        )
    tls, cluster = _SCHEMES[scheme]
    # Userinfo ends at the *last* '@' so that a raw '@', '/', '?' or '#' in a password works.
    at = rest.rfind("@")
    userinfo, location = (rest[:at], rest[at + 1:]) if at >= 0 else (None, rest)
    if "?" in location or "#" in location:
        raise _error("query strings and fragments are not supported")
    hosts_text, slash, path = location.partition("/")
    username = password = None
    if userinfo is not None:
        user_text, colon, pass_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(pass_text) if colon and pass_text else None
    if not hosts_text:
        raise _error("missing host")
    parts = hosts_text.split(",")
    if len(parts) > 1 and not cluster:
        raise _error(f"several hosts need {scheme}+cluster:// (Redis Cluster seeds)")
    nodes = tuple(dict.fromkeys(_parse_node(part) for part in parts))
    db = 0
    if path:
        if not path.isdigit():
            raise _error("database must be a number")
        db = int(path)
    if cluster and db:
        raise _error("Redis Cluster has only database 0")
    return RemoteURL(
        nodes=nodes, cluster=cluster, tls=tls, db=db, username=username, password=password
    )


def _parse_seeds(raws: Sequence[str]) -> list[RemoteURL]:
    """Each seed of a list, an error naming the seed by its position (never its text)."""
    urls = []
    for number, raw in enumerate(raws, start=1):
        try:
            urls.append(_parse_one(raw))
        except ValueError as exc:
            raise _error(f"seed {number}: {str(exc).removeprefix(f'{SETTING}: ')}") from None
    return urls


def _merge_seeds(urls: Sequence[RemoteURL]) -> RemoteURL:
    first = urls[0]
    for number, url in enumerate(urls, start=1):
        if url.tls != first.tls:
            raise _error(f"seed {number}: cluster seeds mix TLS and plain connections")
        if (url.username, url.password) != (first.username, first.password):
            raise _error(f"seed {number}: cluster seeds carry different credentials")
        if url.db:
            raise _error(f"seed {number}: Redis Cluster has only database 0")
    nodes = tuple(dict.fromkeys(node for url in urls for node in url.nodes))
    return RemoteURL(
        nodes=nodes, cluster=True, tls=first.tls, db=0,
        username=first.username, password=first.password,
    )


def parse_remote_url(
    value: str | Sequence[str],
    *,
    password_env: str | None = None,
    environ: Mapping[str, str] | None = None,
    url_password_ok: bool = True,
) -> RemoteURL:
    """Parse and check ``remote_url``; raises ``ValueError`` naming the setting on bad input.

    ``password_env`` names an environment variable holding the password (read now, from
    ``environ`` or ``os.environ``). Giving a password both ways is refused: which one wins
    would be a guess. ``url_password_ok=False`` refuses a password inside the URL (the
    engine's config: vLLM logs it verbatim). Error messages never contain the value.
    """
    if isinstance(value, str):
        url = _parse_one(value)
    elif isinstance(value, Sequence) and value and all(isinstance(v, str) for v in value):
        url = _merge_seeds(_parse_seeds(value))
    else:
        raise _error("expected a URL string or a non-empty list of cluster seed URLs")
    if url.password is not None and not url_password_ok:
        raise _error(
            "holds a password, and vLLM logs kv_connector_extra_config verbatim at start-up, "
            "so it has already reached this server's log: rotate it, and name an environment "
            f"variable holding the new one in "
            f"{PASSWORD_ENV_SETTING} instead (or set {URL_PASSWORD_OK_SETTING}: true to accept that)"
        )
    if password_env is None or password_env == "":
        return url
    if not isinstance(password_env, str) or not _ENV_NAME.match(password_env):
        raise _error(f"{PASSWORD_ENV_SETTING} must be an environment variable name")
    if url.password is not None:
        raise _error(f"a password is given both in the URL and by {PASSWORD_ENV_SETTING}")
    env = os.environ if environ is None else environ
    secret = env.get(password_env)
    if not secret:
        # Not named here: a password typed into remote_password_env by mistake would show.
        raise _error(f"the environment variable named by {PASSWORD_ENV_SETTING} is not set or empty")
    return RemoteURL(
        nodes=url.nodes, cluster=url.cluster, tls=url.tls, db=url.db,
        username=url.username, password=secret,
    )


def check_prefix(prefix: str) -> str:
    """A key prefix usable in Redis Cluster and in a SCAN MATCH pattern, or ``ValueError``.

    Printable ASCII (keys are encoded as ASCII), no whitespace, no hash-tag braces, no ``:``
    separator, no glob characters. The message describes the rule, never the value.
    """
    if (
        not isinstance(prefix, str)
        or not 0 < len(prefix) <= PREFIX_MAX_CHARS
        or not all("!" <= c <= "~" for c in prefix)
        or _PREFIX_FORBIDDEN & set(prefix)
    ):
        raise ValueError(
            f"remote key prefix must be 1 to {PREFIX_MAX_CHARS} printable ASCII characters "
            "without whitespace, '{', '}', ':' or the glob characters * ? [ ] \\"
        )
    return prefix
