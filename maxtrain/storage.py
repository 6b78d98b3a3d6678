"""Where paths may point: local and shared (POSIX) filesystems, and, where a key says so, object
stores (`s3://bucket/prefix` on any S3-compatible endpoint, `gs://bucket/prefix`).

One path layer over `obstore` (the Rust `object_store` crate's Python binding: S3, GCS, retries
with backoff, multipart uploads, conditional puts):

- `path_problem(what, path, urls=...)`: the one line saying why a path cannot be used: a URL
  where the key takes only local paths (taken as a local path, `s3://b/x` would become a directory
  named `s3:` in the working directory: on a cluster, on one node's disk, gone with it), a scheme
  we do not support, or a URL carrying credentials or a presigned query (refused without
  repeating it). Credentials come only from the standard chains (AWS environment variables,
  profile files, instance or pod identity; Google application-default credentials).
- `read_bytes`, `read_range`, `write_bytes` (optionally create-only or If-Match: conditional
  puts), `exists`, `list_objects`, `download`, `upload` (multipart above `MULTIPART_BYTES`),
  `delete`, each raising `StorageError`, one line naming the URL.
- `publish(local_dir, url)`: a directory's files put under a prefix, the `last` ones (a manifest)
  after everything they describe, so a reader that finds the manifest finds its shards.
- `stage(url, cache_dir)`: a prefix mirrored into a local cache (re-fetched when an object's ETag
  changes; the ETags kept in `cache_dir/.etags`, outside the copy), so readers that need files
  (shards, Orbax's checkpoints) read local copies.

The endpoint and region come from the standard AWS variables (`AWS_ENDPOINT_URL`, `AWS_REGION`);
a plain-HTTP endpoint is allowed only when it is the one the user named there. jax-free; obstore
is imported on first use.
"""

from __future__ import annotations

import datetime
import os
import re
import tempfile

from maxtrain.errors import ConfigError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
OBJECT_STORES = ("s3", "gs")
MULTIPART_BYTES = 64 << 20  # larger files go up in parts of this size
DEFAULT_CACHE = "~/.cache/maxtrain/objects"  # where copies go when no `object_cache` is given
# 5xx and throttling (429/503) are retried with exponential backoff
RETRIES = {"max_retries": 8, "backoff": {"init_backoff": datetime.timedelta(seconds=0.1),
                                          "max_backoff": datetime.timedelta(seconds=10), "base": 2.0},
           "retry_timeout": datetime.timedelta(minutes=10)}
# a request may take as long as its body needs (a 5 GB shard on a slow link), but a connection that
# stops sending is dropped after a minute and retried (a cut download resumes with a Range request)
CLIENT = {"timeout": datetime.timedelta(hours=6), "read_timeout": datetime.timedelta(seconds=60),
          "connect_timeout": datetime.timedelta(seconds=10)}
# the environment that says which store and who: what a process on another node needs to reach the
# same buckets (`maxtrain prepare --engine ray` sends the ones set with its tasks)
ENV_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE",
                 "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS",
                 "GOOGLE_SERVICE_ACCOUNT_KEY")
_ENV_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GOOGLE_SERVICE_ACCOUNT_KEY")


class StorageError(ConfigError):
    """An object-store request failed (not found, refused, unreachable): one line naming the URL."""


class NotFound(StorageError):
    """The object is not there."""


class PreconditionFailed(StorageError):
    """A conditional put lost: the object exists (create-only) or is no longer the version named (If-Match)."""


def url_scheme(path) -> str | None:
    """The URL scheme `path` starts with (`s3`, `gs`, ...), or None for a plain path."""
    match = _SCHEME.match(path) if isinstance(path, str) else None
    return match.group(1).lower() if match else None


def is_url(path) -> bool:
    return url_scheme(path) is not None


def path_problem(what: str, path, *, urls: bool = False) -> str | None:
    """One line saying why `path` (given as `what`) cannot be used, or None when it can. With
    `urls`, `s3://` and `gs://` URLs are accepted (and checked); without, any URL is refused."""
    scheme = url_scheme(path)
    if scheme is None:
        if isinstance(path, str) and re.match(r"^(s3|gs):/[^/]", path, re.IGNORECASE):  # one slash short
            return f"{what}={_shown(path)}: did you mean {path[:3]}//{path[4:]}? (`{path[:4]}/` is not a URL)"
        return None
    if not urls:
        where = ("data.path, data.eval_path, run_dir, checkpoint.dir, checkpoint.init_from, checkpoint.resume_from, "
                 "checkpoint verify, prepare and convert")
        return (f"{what}={_shown(path)}: {scheme}:// paths are not supported here (object stores work for {where}, "
                f"not yet for {what}); give a local or shared-filesystem path (a mounted bucket works)")
    if scheme not in OBJECT_STORES:
        return (f"{what}={_shown(path)}: {scheme}:// is not a supported object store; use s3://BUCKET/PREFIX "
                f"(any S3-compatible endpoint) or gs://BUCKET/PREFIX, or a local path")
    rest = path[len(scheme) + 3:]
    bucket = rest.split("/", 1)[0]
    if "@" in bucket or ":" in bucket or "@" in rest.split("?", 1)[0] and ":" in rest.split("@", 1)[0]:
        return (f"{what}: a URL with credentials in it is refused (not repeated here); give them through the "
                f"standard chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, instance identity; "
                f"GOOGLE_APPLICATION_CREDENTIALS) and the URL as {scheme}://BUCKET/PREFIX")
    if "?" in rest or "#" in rest:
        return (f"{what}: a URL with a query (a presigned URL?) is refused (not repeated here); give "
                f"{scheme}://BUCKET/PREFIX and credentials through the standard chain")
    if not bucket:
        return f"{what}={_shown(path)}: no bucket; give {scheme}://BUCKET/PREFIX"
    if any(part in (".", "..") for part in rest.split("/")[1:]):
        return f"{what}={_shown(path)}: `.` and `..` are not path segments in an object store; give the prefix itself"
    return None


def _shown(path: str) -> str:
    """A path as an error message may show it: a URL's credentials (everything up to the last `@`:
    a secret may hold `/`) and query left out."""
    scheme = url_scheme(path)
    if scheme is None:
        return path
    rest = path[len(scheme) + 3:].split("?", 1)[0].split("#", 1)[0]
    if "@" in rest:
        return f"{scheme}://***@{rest.rsplit('@', 1)[-1]}"
    return f"{scheme}://{rest}"


def mixture_paths(value) -> list:
    """The paths in a `data.path`-style value: one path, a list of them, or a list of {path, weight}."""
    items = value if isinstance(value, list) else [value]
    return [item.get("path") if isinstance(item, dict) else item for item in items if item is not None]


def join(url: str, *parts: str) -> str:
    """`url` with `parts` appended, one slash between each (a URL or a local path)."""
    if not is_url(url):
        return os.path.join(url, *parts)
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


# ---------------------------------------------------------------- requests


def _split(url: str) -> tuple[str, str, str]:
    """`s3://bucket/a/b` -> ("s3", "bucket", "a/b")."""
    problem = path_problem("path", url, urls=True)
    if problem is None and any(c in url for c in "*[]"):
        problem = f"{_shown(url)}: wildcards are not expanded in object-store URLs; give a prefix (every object under it)"
    if problem:
        raise ConfigError(problem)
    scheme = url_scheme(url)
    bucket, _, key = url[len(scheme) + 3:].partition("/")
    return scheme, bucket, key.strip("/")


def _store(scheme: str, bucket: str):
    """The obstore store of a bucket, configured from the standard environment (credentials, region,
    endpoint); plain HTTP only to an endpoint the user named as such."""
    from obstore.store import GCSStore, S3Store

    if scheme == "gs":
        return GCSStore(bucket, retry_config=RETRIES, client_options=CLIENT)
    endpoint = _s3_endpoint()
    client = {**CLIENT, "allow_http": True} if endpoint and endpoint.startswith("http://") else CLIENT
    config = {} if _s3_region() else {"region": "us-east-1"}
    return S3Store(bucket, config=config, client_options=client, retry_config=RETRIES)


def tensorstore_kvstore(url: str) -> dict:
    """TensorStore's kvstore spec for an `s3://` prefix (what Orbax writes checkpoints through):
    endpoint and region from the standard AWS variables, credentials from the environment when
    its keys are set, otherwise from the default chain (profile files, instance or pod identity).
    Requests are retried (5xx, throttling) with backoff for about a minute, not TensorStore's
    default quarter of an hour: a store that stays down fails the save, which the run reports."""
    scheme, bucket, key = _split(url)
    if scheme != "s3":
        raise ValueError(f"tensorstore_kvstore: not an s3:// URL: {_shown(url)}")
    spec = {"driver": "s3", "bucket": bucket, "path": key,
            "aws_region": _s3_region() or "us-east-1",
            "aws_credentials": {"type": "environment" if os.environ.get("AWS_ACCESS_KEY_ID") else "default"},
            "s3_request_retries": {"max_retries": 8, "initial_delay": "0.1s", "max_delay": "10s"}}
    if endpoint := _s3_endpoint():
        spec["endpoint"] = endpoint
    return spec


def _s3_endpoint() -> str | None:
    """The S3 endpoint the user named (the standard AWS variables), or None for AWS itself."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _s3_region() -> str | None:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")


def _failed(url: str, e: Exception) -> StorageError:
    """One line for a failed request: what, where; never the request's headers or query."""
    if isinstance(e, FileNotFoundError):
        return NotFound(f"{_shown(url)} not found")
    text = str(e)
    if "169.254.169.254" in text or "metadata.google.internal" in text:  # the chain fell through to instance identity
        return StorageError(f"{_shown(url)}: no credentials found (tried the environment and the instance or pod "
                            f"identity); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (S3) or "
                            f"GOOGLE_APPLICATION_CREDENTIALS (GCS)")
    status = re.search(r"status code: (\d{3}[^:<]*)", text)
    if status:  # the server's answer: its status and error code, never its body (it may echo a key id)
        code = re.search(r"<Code>([A-Za-z]+)</Code>", text)
        first = f"HTTP {status.group(1).strip()}" + (f" ({code.group(1)})" if code else "")
    else:
        first = re.sub(r"https?://\S+", lambda m: m.group(0).split("?", 1)[0], (text.strip().splitlines() or [""])[0])
    return StorageError(redacted(f"{_shown(url)}: {type(e).__name__}: {first[:300]}"))


def redacted(message: str) -> str:
    """`message` with the values of the credential variables in the environment blanked."""
    for name in _ENV_SECRETS:
        value = os.environ.get(name)
        if value and len(value) >= 8:
            message = message.replace(value, "***")
    return message


def read_bytes(url: str) -> bytes:
    import obstore

    scheme, bucket, key = _split(url)
    try:
        return bytes(obstore.get(_store(scheme, bucket), key).bytes())
    except Exception as e:
        raise _failed(url, e) from None


def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes `start` to `end` (exclusive) of the object at `url`; fewer where the object ends first."""
    import obstore

    if end <= start:
        return b""
    scheme, bucket, key = _split(url)
    try:
        return bytes(obstore.get_range(_store(scheme, bucket), key, start=start, end=end))
    except Exception as e:
        if "range" in str(e).lower() and "not satisf" in str(e).lower():  # starts at or past the end
            return b""
        raise _failed(url, e) from None


def exists(url: str) -> bool:
    import obstore

    scheme, bucket, key = _split(url)
    try:
        obstore.head(_store(scheme, bucket), key)
        return True
    except FileNotFoundError:
        return False
    except Exception as e:
        raise _failed(url, e) from None


def write_bytes(url: str, data: bytes, *, create: bool = False, etag: str | None = None) -> str:
    """Puts `data` at `url`; `create`: only if nothing is there (a conditional put, If-None-Match);
    `etag`: only if the object is still that version (If-Match). Returns the new ETag. A failed
    precondition raises `PreconditionFailed` naming it."""
    return put_object(url, data, create=create, match={"e_tag": etag} if etag else None)["e_tag"]


def put_object(url: str, data: bytes, *, create: bool = False, match: dict | None = None) -> dict:
    """`write_bytes` returning the new version as {"e_tag", "version"}; `match`: such a version (from
    `head` or an earlier put), the put made only if the object is still it. S3 matches the ETag,
    GCS the generation (`version`)."""
    import obstore

    scheme, bucket, key = _split(url)
    version = {k: match[k] for k in ("e_tag", "version") if match and match.get(k)}
    mode = "create" if create else (version or "overwrite")
    try:
        result = obstore.put(_store(scheme, bucket), key, data, mode=mode)
        return {"e_tag": result.get("e_tag"), "version": result.get("version")}
    except Exception as e:
        failed = _failed(url, e)
        if type(e).__name__ in ("PreconditionError", "AlreadyExistsError"):
            raise PreconditionFailed(str(failed)) from None
        raise failed from None


def list_objects(url: str) -> list[dict]:
    """Every object under the prefix `url`: {"key": relative to the prefix, "size", "e_tag",
    "last_modified" (the server's clock, a datetime)}."""
    import obstore

    scheme, bucket, prefix = _split(url)
    prefix = prefix + "/" if prefix else ""
    try:
        found = [m for batch in obstore.list(_store(scheme, bucket), prefix or None) for m in batch]
    except Exception as e:
        raise _failed(url, e) from None
    keys = {m["path"] for m in found}
    # an empty "folder" object (a console's `sub/`, listed as `sub`) beside the objects under it
    return [{"key": m["path"][len(prefix):], "size": m["size"], "e_tag": m.get("e_tag"),
             "last_modified": m.get("last_modified")} for m in found
            if m["path"].startswith(prefix) and m["path"] != prefix
            and not (m["size"] == 0 and any(k.startswith(m["path"] + "/") for k in keys))]


def list_prefixes(url: str) -> list[str]:
    """The names one level under the prefix `url` (its "subdirectories"). A server with directories
    underneath (SeaweedFS) may still list one whose objects were all deleted."""
    import obstore

    scheme, bucket, prefix = _split(url)
    try:
        found = obstore.list_with_delimiter(_store(scheme, bucket), prefix + "/" if prefix else None)
    except Exception as e:
        raise _failed(url, e) from None
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"])


def head(url: str) -> dict | None:
    """{"size", "e_tag", "version" (GCS's generation), "last_modified" (the server's clock)} of the
    object at `url`; None when there is none."""
    import obstore

    scheme, bucket, key = _split(url)
    try:
        m = obstore.head(_store(scheme, bucket), key)
    except FileNotFoundError:
        return None
    except Exception as e:
        raise _failed(url, e) from None
    return {"size": m["size"], "e_tag": m.get("e_tag"), "version": m.get("version"),
            "last_modified": m.get("last_modified")}


def delete_prefix(url: str) -> int:
    """Removes every object under the prefix `url`; returns how many there were."""
    objects = list_objects(url)
    for obj in objects:
        delete(join(url, obj["key"]))
    return len(objects)


def delete(url: str) -> None:
    """Removes the object at `url` (nothing there is not an error)."""
    import obstore

    scheme, bucket, key = _split(url)
    try:
        obstore.delete(_store(scheme, bucket), key)
    except FileNotFoundError:
        pass
    except Exception as e:
        raise _failed(url, e) from None


def upload(local: str, url: str) -> str:
    """A local file put at `url`, in parts of `MULTIPART_BYTES` when larger. Returns the ETag."""
    import obstore

    scheme, bucket, key = _split(url)
    try:
        with open(local, "rb") as f:
            return obstore.put(_store(scheme, bucket), key, f, chunk_size=MULTIPART_BYTES)["e_tag"]
    except Exception as e:
        raise _failed(url, e) from None


def download(url: str, local: str, etag: str | None = None) -> None:
    """The object at `url` written to `local` (through a temporary file beside it, then renamed:
    a reader never sees half an object); `etag`: only that version (a changed object is an error)."""
    import obstore

    scheme, bucket, key = _split(url)
    try:
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(local) or ".", prefix=".part-")
    except OSError as e:
        raise StorageError(f"{_shown(url)}: cannot write into {os.path.dirname(local)} ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            got = obstore.get(_store(scheme, bucket), key, options={"if_match": etag} if etag else None)
            for chunk in got.stream(min_chunk_size=8 << 20):
                f.write(chunk)
        os.replace(tmp, local)
    except Exception as e:
        if type(e).__name__ == "PreconditionError":
            raise StorageError(f"{_shown(url)} changed while it was being copied; run again") from None
        raise _failed(url, e) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def require_empty(url: str, what: str | None = None) -> None:
    """Refuses, in one line, a prefix that already holds objects (an output must be a new prefix)."""
    if list_objects(url):
        raise StorageError(f"{what + ' ' if what else ''}{_shown(url)} already holds objects; choose a new prefix")


def publish(local_dir: str, url: str, *, last: tuple[str, ...] = ()) -> int:
    """Every file under `local_dir` put under the prefix `url`, the names in `last` after all others.
    Refuses a prefix that already holds objects. Returns the number of files."""
    require_empty(url)
    files = sorted(os.path.relpath(os.path.join(d, f), local_dir) for d, _, fs in os.walk(local_dir) for f in fs)
    for rel in sorted(files, key=lambda r: r.replace(os.sep, "/") in last):
        upload(os.path.join(local_dir, rel), join(url, rel.replace(os.sep, "/")))
    return len(files)


def cache_path(url: str, cache_dir: str) -> str:
    """Where `stage` mirrors the prefix `url` under `cache_dir`."""
    scheme, bucket, key = _split(url)
    return os.path.join(os.path.expanduser(cache_dir), scheme, bucket, *[p for p in key.split("/") if p])


def stage(url: str, cache_dir: str, keep=None, objects: list[dict] | None = None) -> str:
    """The prefix `url` mirrored into `cache_dir` (each object fetched unless a copy with its ETag is
    there; `keep(key)`: only the keys it accepts; `objects`: the prefix's listing, if at hand);
    returns the local directory. Several processes may stage at once: each object lands by
    rename, and a copy is re-fetched when its object's ETag changed."""
    root = cache_path(url, cache_dir)
    tags = os.path.join(os.path.expanduser(cache_dir), ".etags", os.path.relpath(root, os.path.expanduser(cache_dir)))
    objects = list_objects(url) if objects is None else objects
    if not objects:
        raise StorageError(f"{_shown(url)} holds no objects")
    for obj in objects:
        if keep is not None and not keep(obj["key"]):
            continue
        local = os.path.join(root, *obj["key"].split("/"))
        tag_file = os.path.join(tags, *obj["key"].split("/"))  # beside the copy's tree, not in it
        if obj["e_tag"] and os.path.exists(local) and os.path.exists(tag_file):
            with open(tag_file) as f:
                if f.read() == obj["e_tag"] and os.path.getsize(local) == obj["size"]:
                    continue
        download(join(url, obj["key"]), local, etag=obj["e_tag"])
        if obj["e_tag"]:
            os.makedirs(os.path.dirname(tag_file), exist_ok=True)
            with open(tag_file + f".{os.getpid()}", "w") as f:
                f.write(obj["e_tag"])
            os.replace(tag_file + f".{os.getpid()}", tag_file)
    return root
