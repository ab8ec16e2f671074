"""Where an ``obstore`` tier is and how its client is made: the tier URL taken apart, and the
``options`` users write in fsspec's terms (what s3fs, gcsfs and adlfs take) mapped to obstore's
store and HTTP-client config. What cannot be mapped is :class:`Unmappable`, naming the option
and why, which the backend turns into a ``ConfigError``; never silently dropped. Plain data in,
plain data out: nothing here imports obstore or talks to a store."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["CLIENT_DEFAULTS", "FSSPEC_NAMES", "Location", "STORE_NAMES", "StoreConfig",
           "Unmappable", "options_problem", "secrets_in", "seconds_option", "split_url",
           "store_config", "url_problem"]

#: URL scheme -> the kind of store
_KINDS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure",
          "abfss": "azure", "azure": "azure"}
STORE_NAMES = {"s3": "S3", "gcs": "GCS", "azure": "Azure"}
#: the fsspec filesystem whose options each store's are written as, for messages
FSSPEC_NAMES = {"s3": "s3fs", "gcs": "gcsfs", "azure": "adlfs"}

#: option keys whose values are credentials (at any depth), replaced by *** in messages
_SECRET_KEY = re.compile(r"key|secret|token|passw|credential|signature|auth|sas|connection", re.I)


#: the client's timeouts unless ``options`` say otherwise: a connection is made in 10 s, a
#: read makes progress every 60 s, and no request (of one part at most) lasts 5 minutes
CLIENT_DEFAULTS = {"connect_timeout": "10s", "read_timeout": "60s", "timeout": "300s"}


# -- where the tier is ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Location:
    """A tier URL taken apart: the kind of store, the bucket (container) and the prefix."""

    kind: str
    bucket: str
    prefix: str
    #: an Azure account named in the URL (``abfs://container@account.dfs.core.windows.net``)
    account: str | None = None


def split_url(url: str) -> Location:
    """``url`` taken apart; ValueError saying what is wrong with it (without quoting it)."""
    scheme, sep, rest = url.partition("://")
    kind = _KINDS.get(scheme.lower()) if sep else None
    if kind is None:
        raise ValueError(f"takes an s3://, gs:// or az:// URL (also s3a://, gcs://, abfs://, "
                         f"abfss://), not {scheme + '://' if sep else 'a path'}")
    if "?" in rest or "#" in rest:
        raise ValueError("has a query or a fragment; give the bucket and the prefix only")
    bucket, _, prefix = rest.partition("/")
    account = None
    if "@" in bucket:
        if kind != "azure":
            raise ValueError("holds credentials before '@'; give them in 'options' (read from "
                             "the environment with { env = \"NAME\" })")
        bucket, _, host = bucket.partition("@")
        account = host.split(".", 1)[0] or None
    if not bucket:
        raise ValueError("names no bucket (container)")
    prefix = prefix.strip("/")
    if prefix and any(seg in ("", ".", "..") for seg in prefix.split("/")):
        raise ValueError("has an empty, '.' or '..' segment in its prefix")
    if "\\" in prefix or "\0" in prefix:
        raise ValueError("has a backslash or a NUL character in its prefix")
    return Location(kind, bucket, prefix, account)


def url_problem(url: str) -> str | None:
    try:
        split_url(url)
    except ValueError as exc:
        return str(exc)
    return None


# -- options in fsspec's terms -> obstore's store config -----------------------------------------

class Unmappable(Exception):
    """An option that cannot be mapped: ``key`` (dotted for nested ones) and why."""

    def __init__(self, key: str, why: str):
        super().__init__(f"options key '{key}' {why}")
        self.key, self.why = key, why


#: fsspec's own client-side caches and buffers: this backend has none, so they change nothing
_NO_EFFECT = frozenset({"use_listings_cache", "listings_expiry_time", "skip_instance_cache",
                        "default_block_size", "default_fill_cache", "default_cache_type",
                        "cache_timeout", "block_size", "blocksize"})

#: refused whatever the store: why, and what to write instead
_REFUSED = {
    "retry_config": "is obstore's retry config; retries are the tier's: set max_attempts and "
                    "retry_seconds in the tier's table",
    "max_concurrency": "is fsspec's transfer concurrency; set the tier's concurrency key",
    "profile": "names an AWS profile, which obstore does not read; give key and secret (read "
               "from the environment with { env = \"NAME\" }), or let obstore find them in the "
               "AWS_* environment variables or the instance's role",
    "credential": "is an Azure credential object, which a config cannot hold; give "
                  "account_key, sas_token or client_id/client_secret/tenant_id, or let obstore "
                  "find them in the AZURE_* environment variables",
    "version_aware": "asks for object versions, which this backend does not use; remove it",
}


def options_problem(options: dict) -> str | None:
    """What is wrong with ``options`` whatever the URL (the rest is checked when the tier is
    built, knowing its store); None when nothing is."""
    for key in options:
        if key in _REFUSED:
            return f"'{key}' {_REFUSED[key]}"
    return None


def _flag(key: str, value: Any) -> bool:
    """A boolean option (TOML's, or a string read from the environment)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0",
                                                            "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise Unmappable(key, "takes true or false")


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise Unmappable(key, f"takes a non-empty string, not {type(value).__name__}")
    return value


def seconds_option(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise Unmappable(key, "takes a positive number of seconds")
    return f"{int(value * 1000)}ms"


def _table(key: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise Unmappable(key, f"takes a table, not {type(value).__name__}")
    return value


@dataclass
class StoreConfig:
    """What a store is built with: its config keys, its HTTP client's, and which option set
    each (so that two options setting one thing are refused)."""

    kind: str
    config: dict[str, Any] = field(default_factory=dict)
    client: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)

    def set(self, option: str, name: str, value: Any, client: bool = False) -> None:
        where = "client." + name if client else name
        earlier = self.origin.get(where)
        if earlier is not None and earlier != option:
            raise Unmappable(option, f"sets what '{earlier}' sets already; keep one of them")
        self.origin[where] = option
        (self.client if client else self.config)[name] = value


def _endpoint(cfg: StoreConfig, option: str, url: Any, name: str) -> None:
    url = _text(option, url)
    if urlsplit(url).scheme not in ("http", "https"):
        raise Unmappable(option, "takes an http:// or https:// URL")
    cfg.set(option, name, url.rstrip("/"))
    if url.startswith("http://"):
        cfg.client["allow_http"] = True


#: s3fs's (and botocore's) names of the credentials and the region -> obstore's
_S3_FIELDS = {"key": "access_key_id", "aws_access_key_id": "access_key_id",
              "secret": "secret_access_key", "aws_secret_access_key": "secret_access_key",
              "token": "session_token", "aws_session_token": "session_token",
              "region": "region", "region_name": "region"}


def _map_s3(cfg: StoreConfig, key: str, value: Any) -> bool:
    """s3fs's options (and botocore's, inside them); False when ``key`` is none of them."""
    if key in _S3_FIELDS:
        cfg.set(key, _S3_FIELDS[key], _text(key, value))
    elif key == "anon":
        if _flag(key, value):
            cfg.set(key, "skip_signature", True)
    elif key == "endpoint_url":
        _endpoint(cfg, key, value, "endpoint")
    elif key == "requester_pays":
        if _flag(key, value):
            cfg.set(key, "request_payer", True)
    elif key == "use_ssl":
        if not _flag(key, value):
            cfg.client["allow_http"] = True
    elif key == "client_kwargs":
        for sub, v in _table(key, value).items():
            name = f"{key}.{sub}"
            if sub == "verify":
                if v is False or (isinstance(v, str) and v.lower() == "false"):
                    cfg.set(name, "allow_invalid_certificates", True, client=True)
                elif isinstance(v, str) and v.lower() != "true":
                    try:
                        pem = Path(v).read_text()
                    except OSError as exc:
                        raise Unmappable(name, f"names a CA bundle that cannot be read "
                                                f"({type(exc).__name__})") from None
                    cfg.set(name, "root_certificate", pem, client=True)
            elif sub in _S3_FIELDS and sub.startswith(("aws_", "region_")):
                cfg.set(name, _S3_FIELDS[sub], _text(name, v))
            elif sub == "endpoint_url":
                _endpoint(cfg, name, v, "endpoint")
            elif sub == "use_ssl":
                if not _flag(name, v):
                    cfg.client["allow_http"] = True
            else:
                raise Unmappable(name, "is a botocore client argument this backend cannot "
                                        "map (it maps endpoint_url, region_name, verify, "
                                        "use_ssl and the aws_* credentials)")
    elif key == "config_kwargs":
        for sub, v in _table(key, value).items():
            name = f"{key}.{sub}"
            if sub == "region_name":
                cfg.set(name, "region", _text(name, v))
            elif sub == "connect_timeout":
                cfg.set(name, "connect_timeout", seconds_option(name, v), client=True)
            elif sub == "read_timeout":
                cfg.set(name, "read_timeout", seconds_option(name, v), client=True)
            elif sub == "max_pool_connections":
                pass  # obstore's pool grows as needed
            elif sub == "signature_version":
                if v != "s3v4":
                    raise Unmappable(name, "can only be \"s3v4\" (obstore signs with SigV4; "
                                            "for unsigned requests set anon = true)")
            elif sub == "s3":
                for s3key, s3value in _table(name, v).items():
                    if s3key != "addressing_style" or s3value not in ("virtual", "path", "auto"):
                        raise Unmappable(f"{name}.{s3key}", "cannot be mapped (only "
                                          "addressing_style = \"virtual\", \"path\" or \"auto\")")
                    if s3value != "auto":
                        cfg.set(f"{name}.{s3key}", "virtual_hosted_style_request",
                                s3value == "virtual")
            elif sub == "proxies":
                proxies = _table(name, v)
                proxy = proxies.get("https") or proxies.get("http")
                if set(proxies) - {"http", "https"} or not proxy:
                    raise Unmappable(name, "takes { https = \"URL\" } (or http)")
                cfg.set(name, "proxy_url", _text(name, proxy), client=True)
            elif sub == "retries":
                raise Unmappable(name, "is botocore's retry config; retries are the tier's: "
                                        "set max_attempts and retry_seconds in the tier's table")
            else:
                raise Unmappable(name, "is a botocore Config argument this backend cannot map "
                                        "(it maps region_name, connect_timeout, read_timeout, "
                                        "max_pool_connections, signature_version, s3."
                                        "addressing_style and proxies)")
    elif key == "s3_additional_kwargs":
        for sub, v in _table(key, value).items():
            name = f"{key}.{sub}"
            if sub == "ServerSideEncryption":
                cfg.set(name, "server_side_encryption", _text(name, v))
            elif sub == "SSEKMSKeyId":
                cfg.set(name, "sse_kms_key_id", _text(name, v))
            elif sub == "RequestPayer":
                cfg.set(name, "request_payer", _text(name, v).lower() == "requester")
            else:
                raise Unmappable(name, "cannot be mapped (only ServerSideEncryption, "
                                        "SSEKMSKeyId and RequestPayer)")
    else:
        return False
    return True


def _map_gcs(cfg: StoreConfig, key: str, value: Any) -> bool:
    """gcsfs's options; False when ``key`` is none of them."""
    if key == "token":
        if isinstance(value, dict):  # a service account's key, as gcsfs takes it
            cfg.set(key, "service_account_key", json.dumps(value))
        elif value in (None, "google_default", "cloud"):
            pass  # obstore looks for application default credentials, then the metadata server
        elif value == "anon":
            cfg.set(key, "skip_signature", True)
        elif value == "browser":
            raise Unmappable(key, "\"browser\" asks for an interactive login, which obstore "
                                   "does not do; give a service account key file")
        else:
            cfg.set(key, "application_credentials", _text(key, value))  # a credentials file
    elif key == "anon":
        if _flag(key, value):
            cfg.set(key, "skip_signature", True)
    elif key == "endpoint_url":
        _endpoint(cfg, key, value, "base_url")
    elif key == "project":
        pass  # gcsfs needs one to create buckets; reading and writing objects does not
    elif key == "requester_pays":
        raise Unmappable(key, "cannot be mapped: obstore's GCS client bills no user project")
    else:
        return False
    return True


def _connection_string(cfg: StoreConfig, key: str, value: Any) -> None:
    """An Azure connection string's parts, each where its own option would put it."""
    parts = {}
    for item in _text(key, value).split(";"):
        name, sep, part = item.strip().partition("=")
        if sep:
            parts[name.strip().lower()] = part.strip()
    if parts.get("usedevelopmentstorage", "").lower() == "true":
        cfg.set(key, "use_emulator", True)
    if "accountname" in parts:
        cfg.set(key, "account_name", parts["accountname"])
    if "accountkey" in parts:
        cfg.set(key, "account_key", parts["accountkey"])
    if "sharedaccesssignature" in parts:
        cfg.set(key, "sas_key", parts["sharedaccesssignature"].lstrip("?"))
    if "blobendpoint" in parts:
        _endpoint(cfg, key, parts["blobendpoint"], "endpoint")
    elif "endpointsuffix" in parts and "accountname" in parts:
        protocol = parts.get("defaultendpointsprotocol", "https")
        _endpoint(cfg, key, f"{protocol}://{parts['accountname']}.blob.{parts['endpointsuffix']}",
                  "endpoint")
    if not ({"accountname", "usedevelopmentstorage"} & set(parts)):
        raise Unmappable(key, "holds no AccountName (nor UseDevelopmentStorage=true)")


def _map_azure(cfg: StoreConfig, key: str, value: Any) -> bool:
    """adlfs's options; False when ``key`` is none of them."""
    if key in ("account_name", "account_key", "client_id", "client_secret", "tenant_id"):
        cfg.set(key, key, _text(key, value))
    elif key == "sas_token":
        cfg.set(key, "sas_key", _text(key, value).lstrip("?"))
    elif key == "connection_string":
        _connection_string(cfg, key, value)
    elif key == "anon":
        if _flag(key, value):
            cfg.set(key, "skip_signature", True)
    elif key == "account_host":
        host = _text(key, value)
        _endpoint(cfg, key, host if "://" in host else f"https://{host}", "endpoint")
    elif key == "endpoint_url":
        _endpoint(cfg, key, value, "endpoint")
    else:
        return False
    return True


_MAPPERS = {"s3": _map_s3, "gcs": _map_gcs, "azure": _map_azure}
#: options of the other stores' fsspec filesystems, to say which store an option belongs to
_ELSEWHERE = {
    "s3": {"account_name", "account_key", "connection_string", "sas_token", "account_host",
           "tenant_id", "client_id", "client_secret", "project"},
    "gcs": {"key", "secret", "client_kwargs", "config_kwargs", "s3_additional_kwargs",
            "account_name", "account_key", "connection_string", "sas_token", "account_host"},
    "azure": {"key", "secret", "client_kwargs", "config_kwargs", "s3_additional_kwargs",
              "project", "region", "region_name"},
}


def store_config(location: Location, options: dict) -> StoreConfig:
    """``options`` (fsspec's terms) as obstore's config for ``location``'s store; raises
    Unmappable for an option that cannot be mapped. Keys that are none of fsspec's are passed
    on as obstore's own (obstore refuses those it does not know, when the store is made)."""
    cfg = StoreConfig(location.kind)
    mapper = _MAPPERS[location.kind]
    for key, value in options.items():
        if key in _REFUSED:
            raise Unmappable(key, _REFUSED[key])
        if key in _NO_EFFECT:
            continue
        if key in _ELSEWHERE[location.kind]:
            raise Unmappable(key, f"is not an option of a {STORE_NAMES[location.kind]} "
                                   f"store (this tier's URL is {location.kind}'s)")
        if mapper(cfg, key, value):
            continue
        if key == "client_options":  # obstore's own HTTP client options
            for sub, v in _table(key, value).items():
                cfg.set(f"{key}.{sub}", sub, v, client=True)
        else:
            cfg.set(key, key, value)  # one of obstore's own config keys (checked when made)
    if location.account:
        cfg.set("url", "account_name", location.account)
    if location.kind == "gcs" and cfg.config.get("skip_signature") and "base_url" in cfg.config:
        # An emulator: obstore's GCS client asks for a token before each write even when it
        # signs nothing, unless the credentials say OAuth is off.
        del cfg.config["skip_signature"]
        cfg.config["service_account_key"] = json.dumps({
            "gcs_base_url": cfg.config["base_url"], "disable_oauth": True,
            "client_email": "", "private_key": "", "private_key_id": ""})
    cfg.client = {**CLIENT_DEFAULTS, **cfg.client}
    return cfg


def secrets_in(options: Any) -> list[str]:
    """Values of option keys that look like credentials (any depth), and the credentials
    inside an Azure connection string."""
    found: list[str] = []
    if isinstance(options, dict):
        for k, v in options.items():
            if isinstance(v, str) and _SECRET_KEY.search(str(k)):
                if len(v) >= 4:
                    found.append(v)
                for part in v.split(";"):
                    name, sep, value = part.partition("=")
                    if sep and _SECRET_KEY.search(name) and len(value.strip()) >= 4:
                        found.append(value.strip())
            else:
                found += secrets_in(v)
    elif isinstance(options, (list, tuple)):
        for v in options:
            found += secrets_in(v)
    return found
