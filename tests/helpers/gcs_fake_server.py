"""The server behind tests/gcs_fake.py: Google Cloud Storage held in memory on 127.0.0.1.

Run as a script (tests/gcs_fake.py starts it; nothing else needs to):

  python tests/gcs_fake_server.py --bucket test-bucket --dir /tmp/certs

It writes a throwaway CA and a server certificate into --dir, listens on a free port of
127.0.0.1, prints `{"port": N}` on stdout once it accepts connections, and exits when its
stdin closes, so it never outlives the process that started it.

One port serves three kinds of client:
- Plain HTTP with the GCS JSON API (/storage/v1, /upload/storage/v1, /download/storage/v1):
  TensorStore (TENSORSTORE_GCS_HTTP_URL) and google-cloud-storage/gcsfs
  (STORAGE_EMULATOR_HOST).
- HTTPS proxy requests (CONNECT storage.googleapis.com:443 / www.googleapis.com:443):
  TensorFlow's GCS filesystem has the real endpoints built in, so it is sent here with
  https_proxy and trusts the throwaway CA through CURL_CA_BUNDLE. The tunnel is TLS
  terminated here and the requests inside it are served like the plain ones, including
  the XML API reads (GET /BUCKET/OBJECT with Range) TensorFlow uses. A CONNECT to any
  other host is refused, so nothing reaches the network through this proxy.
- GCE metadata probes (/computeMetadata/...) get a 404: "not on GCE", at once.

Faults on demand (`/_fake/faults`, `FakeGcs.set_faults`): a share of the storage requests
answered 429 or 503, a share whose connection is closed with no answer, and requests
whose object name holds a given text held back for a given number of seconds first.
Faults strike before a request is carried out, so a failed write has changed nothing.

Only what the clients above use is implemented: objects with generations and the
ifGeneration(Not)Match / ifMetageneration(Not)Match preconditions (TensorStore's atomic
writes depend on them), media/multipart/resumable uploads, ranged reads, listing with
prefix/delimiter/startOffset/endOffset/pages, rewrite/copy, delete. Anything else gets a
501 that names the request, so a gap shows up as an error rather than as wrong data.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import email.parser
import email.policy
import hashlib
import http.server
import json
import os
import random
import re
import socketserver
import ssl
import sys
import threading
import time
import urllib.parse
import uuid

try:  # installed with google-cloud-storage, which checks downloads against it
  import google_crc32c
except ImportError:
  google_crc32c = None

# Hosts whose CONNECT tunnels are served here; *.storage.googleapis.com is the XML API's
# virtual-hosted form (BUCKET.storage.googleapis.com/OBJECT).
_TLS_HOSTS = ("storage.googleapis.com", "www.googleapis.com")
_TLS_HOST_SUFFIX = ".storage.googleapis.com"

_PAGE_SIZE = 1000  # the most GCS returns in one listing page


# ------------------------------------------------------------------------------------
# Certificates


def write_certificates(directory: str) -> tuple[str, str, str]:
  """(ca.pem, server.pem, server.key) in `directory`: a CA made for this run only and a
  certificate it signed for the GCS hosts. Nothing outside this run trusts the CA."""
  from cryptography import x509
  from cryptography.hazmat.primitives import hashes, serialization
  from cryptography.hazmat.primitives.asymmetric import ec
  from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

  now = datetime.datetime.now(datetime.UTC)
  # EC keys: generated in milliseconds, where RSA would cost a noticeable fraction of
  # a second for every fake started.
  ca_key = ec.generate_private_key(ec.SECP256R1())
  ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gcs-fake test CA")])
  ca_cert = (
    x509.CertificateBuilder()
    .subject_name(ca_name)
    .issuer_name(ca_name)
    .public_key(ca_key.public_key())
    .serial_number(x509.random_serial_number())
    .not_valid_before(now - datetime.timedelta(days=1))
    .not_valid_after(now + datetime.timedelta(days=7))
    .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
    .add_extension(
      x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
      ),
      critical=True,
    )
    .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
    .sign(ca_key, hashes.SHA256())
  )
  key = ec.generate_private_key(ec.SECP256R1())
  names = [x509.DNSName(h) for h in _TLS_HOSTS] + [x509.DNSName("*" + _TLS_HOST_SUFFIX)]
  cert = (
    x509.CertificateBuilder()
    .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _TLS_HOSTS[0])]))
    .issuer_name(ca_name)
    .public_key(key.public_key())
    .serial_number(x509.random_serial_number())
    .not_valid_before(now - datetime.timedelta(days=1))
    .not_valid_after(now + datetime.timedelta(days=7))
    .add_extension(x509.SubjectAlternativeName(names), critical=False)
    .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    .add_extension(
      x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
    )
    .sign(ca_key, hashes.SHA256())
  )
  paths = tuple(os.path.join(directory, n) for n in ("ca.pem", "server.pem", "server.key"))
  pem = serialization.Encoding.PEM
  with open(paths[0], "wb") as f:
    f.write(ca_cert.public_bytes(pem))
  with open(paths[1], "wb") as f:
    f.write(cert.public_bytes(pem))
  with open(paths[2], "wb") as f:
    f.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
  return paths


# ------------------------------------------------------------------------------------
# Storage


class _Object:
  __slots__ = (
    "data",
    "generation",
    "metageneration",
    "content_type",
    "metadata",
    "created",
    "updated",
    "md5",
    "crc32c",
  )

  def __init__(self, data: bytes, generation: int, content_type: str, metadata: dict | None = None):
    self.data = data
    self.generation = generation
    self.metageneration = 1
    self.content_type = content_type or "application/octet-stream"
    self.metadata = metadata or None
    self.created = self.updated = time.time()
    self.md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
    self.crc32c = (
      base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()
      if google_crc32c is not None
      else None
    )

  def hashes(self) -> str:
    """The x-goog-hash header."""
    return f"crc32c={self.crc32c},md5={self.md5}" if self.crc32c else f"md5={self.md5}"


class _PreconditionFailed(Exception):
  def __init__(self, status: int):
    super().__init__(status)
    self.status = status


def _rfc3339(t: float) -> str:
  return (
    datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
  )


class Store:
  """Buckets of objects in memory; every method is atomic (one lock)."""

  def __init__(self, buckets):
    self._lock = threading.Lock()
    self.buckets: dict[str, dict[str, _Object]] = {b: {} for b in buckets}
    self._created = time.time()
    self._last_generation = 0
    self.uploads: dict[str, dict] = {}  # resumable upload sessions by upload_id

  def _next_generation(self) -> int:
    # Like GCS: microseconds since the epoch, strictly increasing, never 0 (0 means
    # "no live object" in preconditions).
    self._last_generation = max(self._last_generation + 1, time.time_ns() // 1000)
    return self._last_generation

  def bucket(self, name: str) -> dict | None:
    return self.buckets.get(name)

  def get(self, bucket: str, name: str) -> _Object | None:
    with self._lock:
      return self.buckets[bucket].get(name)

  def put(
    self,
    bucket: str,
    name: str,
    data: bytes,
    content_type: str,
    conditions: dict,
    metadata: dict | None = None,
  ) -> _Object:
    with self._lock:
      objects = self.buckets[bucket]
      check_preconditions(objects.get(name), conditions, write=True)
      obj = _Object(data, self._next_generation(), content_type, metadata)
      objects[name] = obj
      return obj

  def delete(self, bucket: str, name: str, conditions: dict) -> bool:
    with self._lock:
      objects = self.buckets[bucket]
      obj = objects.get(name)
      if obj is None:
        return False
      check_preconditions(obj, conditions, write=True)
      del objects[name]
      return True

  def update_metadata(
    self, bucket: str, name: str, patch: dict, conditions: dict
  ) -> _Object | None:
    with self._lock:
      obj = self.buckets[bucket].get(name)
      if obj is None:
        return None
      check_preconditions(obj, conditions, write=True)
      if "contentType" in patch:
        obj.content_type = patch["contentType"] or "application/octet-stream"
      if "metadata" in patch:
        merged = dict(obj.metadata or {})
        for k, v in (patch["metadata"] or {}).items():
          if v is None:
            merged.pop(k, None)
          else:
            merged[k] = v
        obj.metadata = merged or None
      obj.metageneration += 1
      obj.updated = time.time()
      return obj

  def names(self, bucket: str) -> list[str]:
    with self._lock:
      return sorted(self.buckets[bucket])

  def clear(self) -> None:
    with self._lock:
      for objects in self.buckets.values():
        objects.clear()
      self.uploads.clear()


def check_preconditions(obj: _Object | None, conditions: dict, write: bool) -> None:
  """Raises _PreconditionFailed as GCS answers: 412 for a failed match; for a failed
  not-match 304 on a read (not modified) and 412 on a write. Generation 0 stands for
  "no live object" on both sides."""
  generation = obj.generation if obj is not None else 0
  metageneration = obj.metageneration if obj is not None else 0
  if "ifGenerationMatch" in conditions and generation != conditions["ifGenerationMatch"]:
    raise _PreconditionFailed(412)
  if (
    "ifMetagenerationMatch" in conditions and metageneration != conditions["ifMetagenerationMatch"]
  ):
    raise _PreconditionFailed(412)
  not_modified = 412 if write else 304
  if "ifGenerationNotMatch" in conditions and generation == conditions["ifGenerationNotMatch"]:
    raise _PreconditionFailed(not_modified)
  if (
    "ifMetagenerationNotMatch" in conditions
    and metageneration == conditions["ifMetagenerationNotMatch"]
  ):
    raise _PreconditionFailed(not_modified)


# ------------------------------------------------------------------------------------
# HTTP


class _HttpError(Exception):
  def __init__(self, status: int, message: str, reason: str = "invalid"):
    super().__init__(message)
    self.status, self.message, self.reason = status, message, reason


_CONDITION_NAMES = (
  "ifGenerationMatch",
  "ifGenerationNotMatch",
  "ifMetagenerationMatch",
  "ifMetagenerationNotMatch",
)
_XML_CONDITION_HEADERS = {
  "x-goog-if-generation-match": "ifGenerationMatch",
  "x-goog-if-metageneration-match": "ifMetagenerationMatch",
}


class Handler(http.server.BaseHTTPRequestHandler):
  """One client connection; after a CONNECT it carries on inside the TLS tunnel."""

  protocol_version = "HTTP/1.1"  # keep-alive: curl reuses connections (and tunnels)
  server_version = "gcs-fake"
  timeout = 120  # an idle keep-alive connection does not hold its thread forever
  # Headers and body go out in separate writes; with Nagle's algorithm the second waits
  # for the client's delayed ACK, up to 40 ms a request.
  disable_nagle_algorithm = True

  server: Server
  _tls = False

  # ---- plumbing ----------------------------------------------------------------

  def log_message(self, format, *args):  # noqa: A002  (the base class's name)
    pass  # requests are recorded by log_request; nothing goes to stderr per request

  def log_request(self, code="-", size="-"):
    self.server.record(
      {
        "method": self.command,
        "host": self.headers.get("Host", "") if self.headers else "",
        "path": getattr(self, "_path", self.path),
        "status": int(code) if str(code).isdigit() else code,
        "tls": self._tls,
        "bytes": len(getattr(self, "_read_body", None) or b""),
        "object": getattr(self, "_subject", ""),
        "fault": getattr(self, "_fault", ""),
      }
    )

  def _send(
    self,
    status: int,
    body: bytes = b"",
    content_type: str = "application/json",
    headers: dict | None = None,
  ) -> None:
    self.send_response(status)
    for name, value in (headers or {}).items():
      self.send_header(name, value)
    if body or status not in (204, 304):
      self.send_header("Content-Type", content_type)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    if self.command != "HEAD" and body:
      self.wfile.write(body)

  def _json(self, status: int, value) -> None:
    self._send(status, json.dumps(value).encode())

  def _error(self, status: int, message: str, reason: str = "invalid") -> None:
    # Drain an unread request body, or it would be parsed as the next request.
    self._body()
    self._json(
      status,
      {
        "error": {
          "code": status,
          "message": message,
          "errors": [{"domain": "global", "reason": reason, "message": message}],
        }
      },
    )

  def _body(self) -> bytes:
    if getattr(self, "_read_body", None) is not None:
      return self._read_body
    if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
      chunks = []
      while True:
        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
          while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass  # trailers
          break
        chunks.append(self.rfile.read(size))
        self.rfile.readline()
      data = b"".join(chunks)
    else:
      data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
    self._read_body = data
    return data

  # ---- HTTPS proxy -------------------------------------------------------------

  def do_CONNECT(self):
    host, _, port = self.path.rpartition(":")
    self._path = self.path
    if port != "443" or not (host in _TLS_HOSTS or host.endswith(_TLS_HOST_SUFFIX)):
      # Anything but GCS through this proxy would be network access: refuse it, and
      # record it so a test can see what tried.
      self._send(
        403, b"gcs-fake proxies only the GCS endpoints\n", "text/plain", {"Connection": "close"}
      )
      self.close_connection = True
      return
    self.send_response(200, "Connection established")
    self.end_headers()
    self.wfile.flush()
    try:
      tls = self.server.tls_context.wrap_socket(self.connection, server_side=True)
    except (ssl.SSLError, OSError) as e:
      sys.stderr.write(f"gcs-fake: TLS handshake for {self.path} failed: {e}\n")
      self.close_connection = True
      return
    # From here on this handler reads and answers requests inside the tunnel.
    self.request = self.connection = tls
    self.rfile = tls.makefile("rb", self.rbufsize)
    self.wfile = socketserver._SocketWriter(tls)
    self._tls = True
    self.close_connection = False

  # ---- dispatch ----------------------------------------------------------------

  def do_GET(self):
    self._dispatch()

  do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

  def _dispatch(self):
    self._read_body = None
    self._fault = ""
    self._body()  # read whatever the request carries, so no answer leaves it unread
    url = urllib.parse.urlsplit(self.path)  # an absolute URL if a client sent one
    raw_path = url.path
    self._path = raw_path
    self._query = {
      k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()
    }
    host = (url.hostname or self.headers.get("Host", "")).split(":")[0].lower()
    self._subject = self._object_name(raw_path)
    if not (
      raw_path.startswith(("/_fake/", "/computeMetadata/")) or self.headers.get(CONTROL_HEADER)
    ):
      fault = self.server.faults.draw(self._subject)
      if fault == "drop":
        self._fault = "drop"
        self.log_request("-")
        self.close_connection = True  # no answer: the client sees the connection close
        return
      if fault:
        self._fault = "error"
        return self._error(
          fault,
          "gcs-fake: injected failure",
          "backendError" if fault >= 500 else "rateLimitExceeded",
        )
    try:
      self._route(host, raw_path)
    except _HttpError as e:
      self._error(e.status, e.message, e.reason)
    except _PreconditionFailed as e:
      if e.status == 304:
        self._body()
        self._send(304)
      else:
        self._error(
          412, "At least one of the pre-conditions you specified did not hold.", "conditionNotMet"
        )
    except (BrokenPipeError, ConnectionResetError):
      self.close_connection = True
    except Exception as e:  # a bug here: answer 500 and say what, do not hang the client
      sys.stderr.write(f"gcs-fake: {self.command} {self.path} failed: {e!r}\n")
      self._error(500, f"gcs-fake internal error: {e!r}", "backendError")

  def _route(self, host: str, raw_path: str) -> None:
    method = self.command
    if raw_path.startswith("/_fake/"):
      return self._control(raw_path[len("/_fake/") :])
    if raw_path.startswith("/computeMetadata/"):
      raise _HttpError(404, "gcs-fake is not a GCE metadata server", "notFound")
    if host.endswith(_TLS_HOST_SUFFIX):  # BUCKET.storage.googleapis.com/OBJECT
      return self._xml(host[: -len(_TLS_HOST_SUFFIX)], raw_path.lstrip("/"))

    m = re.fullmatch(r"/upload/storage/v1/b/([^/]+)/o", raw_path)
    if m:
      return self._upload(self._bucket(m.group(1)))
    m = re.fullmatch(r"/download/storage/v1/b/([^/]+)/o/(.+)", raw_path)
    if m and method in ("GET", "HEAD"):
      return self._read(self._bucket(m.group(1)), _unquote(m.group(2)), media=True)
    # The JSON API; STORAGE_EMULATOR_HOST clients may leave out /storage/v1.
    m = re.fullmatch(r"(?:/storage/v1)?/b/([^/]+)(/o(?:/(.*))?)?", raw_path)
    if m:
      bucket = self._bucket(m.group(1))
      if m.group(2) is None:
        if method == "GET":
          return self._json(200, self._bucket_resource(m.group(1)))
      elif m.group(3) is None:
        if method == "GET":
          return self._list(bucket)
        if method == "POST" and "uploadType" in self._query:
          return self._upload(bucket)
      else:
        return self._object(bucket, m.group(3))
      raise _HttpError(501, f"gcs-fake: {method} {raw_path} is not implemented")
    if raw_path.startswith(("/storage/", "/upload/", "/download/", "/batch/")):
      raise _HttpError(501, f"gcs-fake: {method} {raw_path} is not implemented")
    # The XML API, path style: /BUCKET/OBJECT (TensorFlow reads objects this way).
    bucket_name, _, object_path = raw_path.lstrip("/").partition("/")
    return self._xml(bucket_name, object_path)

  def _object_name(self, raw_path: str) -> str:
    """The object a request is about (for the stall fault's match), "" if none."""
    if self._query.get("name"):
      return self._query["name"]
    m = re.search(r"/b/[^/]+/o/([^/]+)", raw_path)
    if m:
      return _unquote(m.group(1))
    if self._query.get("upload_id"):
      upload = self.server.store.uploads.get(self._query["upload_id"])
      return (upload or {}).get("name", "")
    return _unquote(raw_path.lstrip("/").partition("/")[2])  # XML API: /BUCKET/OBJECT

  def _bucket(self, quoted_name: str) -> str:
    name = _unquote(quoted_name)
    if self.server.store.bucket(name) is None:
      raise _HttpError(404, f"The specified bucket {name} does not exist.", "notFound")
    return name

  def _conditions(self, prefix: str = "") -> dict:
    conditions = {}
    for name in _CONDITION_NAMES:
      # The source's conditions of a copy: ifGenerationMatch -> ifSourceGenerationMatch.
      value = self._query.get(prefix + name[2:] if prefix else name)
      if value is not None and value != "":
        conditions[name] = int(value)
    return conditions

  # ---- JSON API ----------------------------------------------------------------

  def _object(self, bucket: str, rest: str) -> None:
    method = self.command
    # Object names in JSON API paths are one percent-encoded segment, so a raw "/"
    # separates the object from a sub-resource.
    m = re.fullmatch(r"(.+?)/(rewriteTo|copyTo)/b/([^/]+)/o/(.+)", rest)
    if m and method == "POST":
      return self._copy(
        bucket,
        _unquote(m.group(1)),
        self._bucket(m.group(3)),
        _unquote(m.group(4)),
        rewrite=m.group(2) == "rewriteTo",
      )
    if rest.endswith("/compose"):
      raise _HttpError(501, "gcs-fake: compose is not implemented")
    name = _unquote(rest)
    if method in ("GET", "HEAD"):
      return self._read(bucket, name, media=self._query.get("alt", "json") != "json")
    if method == "DELETE":
      self._check_generation(bucket, name)
      if not self.server.store.delete(bucket, name, self._conditions()):
        raise _HttpError(404, f"No such object: {bucket}/{name}", "notFound")
      return self._send(204)
    if method in ("PATCH", "PUT"):
      patch = json.loads(self._body() or b"{}")
      obj = self.server.store.update_metadata(bucket, name, patch, self._conditions())
      if obj is None:
        raise _HttpError(404, f"No such object: {bucket}/{name}", "notFound")
      return self._json(200, self._resource(bucket, name, obj))
    raise _HttpError(501, f"gcs-fake: {method} {self.path} is not implemented")

  def _check_generation(self, bucket: str, name: str) -> None:
    """A request for a `generation` other than the live one: only live ones are kept."""
    wanted = self._query.get("generation")
    if wanted:
      obj = self.server.store.get(bucket, name)
      if obj is None or obj.generation != int(wanted):
        raise _HttpError(404, f"No such object: {bucket}/{name}#{wanted}", "notFound")

  def _read(self, bucket: str, name: str, media: bool, conditions: dict | None = None) -> None:
    self._check_generation(bucket, name)
    obj = self.server.store.get(bucket, name)
    if obj is None:
      raise _HttpError(404, f"No such object: {bucket}/{name}", "notFound")
    check_preconditions(obj, self._conditions() if conditions is None else conditions, write=False)
    if not media:
      return self._json(200, self._resource(bucket, name, obj))
    headers = {
      "x-goog-generation": str(obj.generation),
      "x-goog-metageneration": str(obj.metageneration),
      "x-goog-stored-content-length": str(len(obj.data)),
      "x-goog-stored-content-encoding": "identity",
      "x-goog-hash": obj.hashes(),
      "ETag": f'"{obj.md5}"',
      "Last-Modified": self.date_time_string(obj.updated),
      "Accept-Ranges": "bytes",
    }
    for key, value in (obj.metadata or {}).items():
      headers[f"x-goog-meta-{key}"] = str(value)
    data, status = obj.data, 200
    requested = self.headers.get("Range")
    if requested:
      span = _byte_range(requested, len(data))
      if span is None:
        # TensorFlow reads blocks past the end of a file and takes a 416 as "EOF".
        return self._send(
          416, b"", "text/plain", {**headers, "Content-Range": f"bytes */{len(data)}"}
        )
      start, end = span
      headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
      data, status = data[start : end + 1], 206
    self._send(status, data, obj.content_type, headers)

  def _list(self, bucket: str) -> None:
    q = self._query
    if q.get("matchGlob"):
      raise _HttpError(501, "gcs-fake: listing with matchGlob is not implemented")
    prefix, delimiter = q.get("prefix", ""), q.get("delimiter", "")
    start, end = q.get("startOffset", ""), q.get("endOffset", "")
    limit = min(int(q.get("maxResults") or _PAGE_SIZE), _PAGE_SIZE)
    after, after_prefix = "", ""
    if q.get("pageToken"):
      token = json.loads(base64.urlsafe_b64decode(q["pageToken"]))
      after, after_prefix = token["after"], token["prefix"]
    store = self.server.store
    items, prefixes, last, truncated = [], [], None, False
    for name in store.names(bucket):
      if (
        not name.startswith(prefix)
        or (start and name < start)
        or (end and name >= end)
        or (after and name <= after)
        or (after_prefix and name.startswith(after_prefix))
      ):
        continue
      rest = name[len(prefix) :]
      if delimiter and delimiter in rest:
        common = prefix + rest[: rest.index(delimiter) + len(delimiter)]
        if prefixes and prefixes[-1] == common:
          continue  # names are sorted: a prefix's names are consecutive
        if len(items) + len(prefixes) == limit:
          truncated = True
          break
        prefixes.append(common)
        last = (name, common)
      else:
        if len(items) + len(prefixes) == limit:
          truncated = True
          break
        obj = store.get(bucket, name)
        if obj is None:
          continue  # deleted since the names were taken
        items.append(self._resource(bucket, name, obj))
        last = (name, "")
    result = {"kind": "storage#objects"}
    if items:
      result["items"] = items
    if prefixes:
      result["prefixes"] = prefixes
    if truncated and last is not None:
      token = json.dumps({"after": last[0], "prefix": last[1]}).encode()
      result["nextPageToken"] = base64.urlsafe_b64encode(token).decode()
    self._json(200, result)

  def _copy(self, bucket: str, name: str, dest_bucket: str, dest_name: str, rewrite: bool) -> None:
    source = self.server.store.get(bucket, name)
    if source is None:
      raise _HttpError(404, f"No such object: {bucket}/{name}", "notFound")
    check_preconditions(source, self._conditions(prefix="ifSource"), write=True)
    body = self._body()
    overrides = json.loads(body) if body.strip() else {}
    obj = self.server.store.put(
      dest_bucket,
      dest_name,
      source.data,
      overrides.get("contentType") or source.content_type,
      self._conditions(),
      overrides.get("metadata", source.metadata),
    )
    resource = self._resource(dest_bucket, dest_name, obj)
    if not rewrite:
      return self._json(200, resource)
    # The whole copy is done in one call, which is what TensorFlow's rename expects.
    self._json(
      200,
      {
        "kind": "storage#rewriteResponse",
        "done": True,
        "totalBytesRewritten": str(len(obj.data)),
        "objectSize": str(len(obj.data)),
        "resource": resource,
      },
    )

  def _upload(self, bucket: str) -> None:
    q = self._query
    if self.command == "PUT" or q.get("upload_id"):
      return self._resumable_chunk(bucket)
    kind = q.get("uploadType", "")
    if kind == "media":
      if not q.get("name"):
        raise _HttpError(400, "Required parameter: name", "required")
      # An empty body is a valid (empty) object: TensorFlow's directory markers.
      obj = self.server.store.put(
        bucket, q["name"], self._body(), self.headers.get("Content-Type", ""), self._conditions()
      )
      return self._json(200, self._resource(bucket, q["name"], obj))
    if kind == "multipart":
      meta, data, content_type = _parse_multipart(
        self.headers.get("Content-Type", ""), self._body()
      )
      name = q.get("name") or meta.get("name")
      if not name:
        raise _HttpError(400, "Required parameter: name", "required")
      obj = self.server.store.put(
        bucket,
        name,
        data,
        meta.get("contentType") or content_type,
        self._conditions(),
        meta.get("metadata"),
      )
      return self._json(200, self._resource(bucket, name, obj))
    if kind == "resumable":
      body = self._body()
      meta = json.loads(body) if body.strip() else {}
      name = q.get("name") or meta.get("name")
      if not name:
        raise _HttpError(400, "Required parameter: name", "required")
      upload_id = uuid.uuid4().hex
      self.server.store.uploads[upload_id] = {
        "bucket": bucket,
        "name": name,
        "data": bytearray(),
        "content_type": meta.get("contentType") or self.headers.get("X-Upload-Content-Type", ""),
        "metadata": meta.get("metadata"),
        "conditions": self._conditions(),
      }
      scheme = "https" if self._tls else "http"
      host = self.headers.get("Host", f"127.0.0.1:{self.server.server_address[1]}")
      location = (
        f"{scheme}://{host}/upload/storage/v1/b/{urllib.parse.quote(bucket)}/o"
        f"?uploadType=resumable&upload_id={upload_id}"
      )
      return self._send(200, b"", headers={"Location": location})
    raise _HttpError(400, f"gcs-fake: uploadType={kind!r} is not supported")

  def _resumable_chunk(self, bucket: str) -> None:
    upload_id = self._query.get("upload_id", "")
    upload = self.server.store.uploads.get(upload_id)
    if upload is None:
      raise _HttpError(404, "No such upload session", "notFound")
    if self.command == "DELETE":  # a cancelled upload
      del self.server.store.uploads[upload_id]
      return self._send(499)
    if "done" in upload:
      # A finished session answers a status query with the object, as GCS does; a
      # client asks after a lost response (TensorFlow's RequestUploadSessionStatus).
      return self._json(200, upload["done"])
    data = self._body()
    total = None
    content_range = self.headers.get("Content-Range", "")
    m = re.fullmatch(r"bytes (?:(\d+)-(\d+)|\*)/(\d+|\*)", content_range.strip())
    if content_range and not m:
      raise _HttpError(400, f"Malformed Content-Range: {content_range}")
    if m:
      if m.group(1) is not None:
        first = int(m.group(1))
        if first > len(upload["data"]):
          raise _HttpError(400, f"Chunk at {first} leaves a gap after {len(upload['data'])} bytes")
        upload["data"][first:] = data  # a resent chunk overwrites
      if m.group(3) != "*":
        total = int(m.group(3))
    else:  # no Content-Range: the body is the whole object (TensorFlow's empty files)
      upload["data"][:] = data
      total = len(data)
    if total is None or len(upload["data"]) < total:
      received = len(upload["data"])
      headers = {"Range": f"bytes=0-{received - 1}"} if received else {}
      return self._send(308, b"", headers=headers)
    obj = self.server.store.put(
      upload["bucket"],
      upload["name"],
      bytes(upload["data"]),
      upload["content_type"],
      upload["conditions"],
      upload["metadata"],
    )
    resource = self._resource(upload["bucket"], upload["name"], obj)
    self.server.store.uploads[upload_id] = {"done": resource}
    self._json(200, resource)

  # ---- XML API -----------------------------------------------------------------

  def _xml(self, bucket_name: str, quoted_object: str) -> None:
    bucket = self._bucket(bucket_name)
    if not quoted_object:
      raise _HttpError(501, f"gcs-fake: XML API {self.command} on a bucket is not implemented")
    name = _unquote(quoted_object)
    conditions = {
      _XML_CONDITION_HEADERS[h.lower()]: int(v)
      for h, v in self.headers.items()
      if h.lower() in _XML_CONDITION_HEADERS
    }
    if self.command in ("GET", "HEAD"):
      return self._read(bucket, name, media=True, conditions=conditions)
    if self.command == "PUT":
      obj = self.server.store.put(
        bucket, name, self._body(), self.headers.get("Content-Type", ""), conditions
      )
      return self._send(
        200, b"", headers={"x-goog-generation": str(obj.generation), "ETag": f'"{obj.md5}"'}
      )
    if self.command == "DELETE":
      if not self.server.store.delete(bucket, name, conditions):
        raise _HttpError(404, f"No such object: {bucket}/{name}", "notFound")
      return self._send(204)
    raise _HttpError(501, f"gcs-fake: XML API {self.command} is not implemented")

  # ---- resources ---------------------------------------------------------------

  def _base_url(self) -> str:
    scheme = "https" if self._tls else "http"
    return f"{scheme}://{self.headers.get('Host', '127.0.0.1')}"

  def _resource(self, bucket: str, name: str, obj: _Object) -> dict:
    quoted = urllib.parse.quote(name, safe="")
    resource = {
      "kind": "storage#object",
      "id": f"{bucket}/{name}/{obj.generation}",
      "selfLink": f"{self._base_url()}/storage/v1/b/{bucket}/o/{quoted}",
      "mediaLink": (
        f"{self._base_url()}/download/storage/v1/b/{bucket}/o/{quoted}"
        f"?generation={obj.generation}&alt=media"
      ),
      "name": name,
      "bucket": bucket,
      "generation": str(obj.generation),
      "metageneration": str(obj.metageneration),
      "contentType": obj.content_type,
      "storageClass": "STANDARD",
      "size": str(len(obj.data)),
      "md5Hash": obj.md5,
      "etag": obj.md5,
      "timeCreated": _rfc3339(obj.created),
      "updated": _rfc3339(obj.updated),
      "timeStorageClassUpdated": _rfc3339(obj.created),
    }
    if obj.crc32c:
      resource["crc32c"] = obj.crc32c
    if obj.metadata:
      resource["metadata"] = dict(obj.metadata)
    return resource

  def _bucket_resource(self, name: str) -> dict:
    created = _rfc3339(self.server.store._created)
    return {
      "kind": "storage#bucket",
      "id": name,
      "name": name,
      "projectNumber": "0",
      "metageneration": "1",
      "location": "US",
      "locationType": "multi-region",
      "storageClass": "STANDARD",
      "timeCreated": created,
      "updated": created,
      "selfLink": f"{self._base_url()}/storage/v1/b/{name}",
    }

  # ---- test control ------------------------------------------------------------

  def _control(self, what: str) -> None:
    """/_fake/...: for the test process only (GCS bucket names cannot start with _)."""
    if what == "reset" and self.command == "POST":
      self.server.store.clear()
      self.server.clear_log()
      self.server.faults.configure()
      return self._json(200, {})
    if what == "log" and self.command == "GET":
      return self._json(200, self.server.log())
    if what == "faults" and self.command == "POST":
      self.server.faults.configure(**json.loads(self._body() or b"{}"))
      return self._json(200, {})
    raise _HttpError(404, f"unknown control request {what}")


def _unquote(quoted: str) -> str:
  return urllib.parse.unquote(quoted)


def _byte_range(header: str, size: int) -> tuple[int, int] | None:
  """(first, last) byte of a single `bytes=` range, or None if it is unsatisfiable."""
  m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
  if not m or (not m.group(1) and not m.group(2)):
    raise _HttpError(400, f"gcs-fake supports one byte range, not {header!r}")
  if not m.group(1):  # a suffix: the last N bytes
    length = int(m.group(2))
    if length == 0 or size == 0:
      return None
    return max(0, size - length), size - 1
  first = int(m.group(1))
  last = int(m.group(2)) if m.group(2) else size - 1
  if first >= size or last < first:
    return None
  return first, min(last, size - 1)


def _parse_multipart(content_type: str, body: bytes) -> tuple[dict, bytes, str]:
  """(metadata, data, data's content type) of a multipart/related upload."""
  message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
    f"Content-Type: {content_type}\r\n\r\n".encode() + body
  )
  parts = list(message.iter_parts()) if message.is_multipart() else []
  if len(parts) != 2:
    raise _HttpError(400, "A multipart upload has a metadata part and a media part")
  meta = json.loads(parts[0].get_payload(decode=True) or b"{}")
  return meta, parts[1].get_payload(decode=True) or b"", parts[1].get_content_type()


# A request carrying this header is never failed on purpose: the test's own reads.
CONTROL_HEADER = "X-Gcs-Fake-Control"


class Faults:
  """What goes wrong, drawn per request from a seeded generator (reproducible counts).

  error_rate: share of requests answered with one of `statuses` (429, 503: what GCS
    answers when a bucket is over its request rate or a backend is busy);
  drop_rate: share of requests whose connection is closed with no answer (a reset);
  stall_s, stall_match, stall_count: the first `stall_count` requests about an object
    whose name contains `stall_match` wait `stall_s` seconds before being served.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._generation = 0  # how many times the faults were set: a stall outlives a test
    self.configure()

  def configure(
    self,
    error_rate: float = 0.0,
    statuses=(429, 503),
    drop_rate: float = 0.0,
    stall_s: float = 0.0,
    stall_match: str = "",
    stall_count: int = 1,
    seed: int = 0,
  ) -> None:
    with self._lock:
      self._generation += 1
      self.error_rate, self.statuses, self.drop_rate = error_rate, tuple(statuses), drop_rate
      self.stall_s, self.stall_match, self.stall_left = stall_s, stall_match, stall_count
      self._random = random.Random(seed)

  def draw(self, name: str):
    """ "drop", an HTTP status to answer, or None (serve it), after any stall."""
    with self._lock:
      generation = self._generation
      stall = (
        self.stall_s > 0
        and self.stall_left > 0
        and bool(self.stall_match)
        and self.stall_match in name
      )
      if stall:
        self.stall_left -= 1
      roll = self._random.random()
      status = self._random.choice(self.statuses) if self.statuses else 503
    if stall:
      time.sleep(self.stall_s)
      if generation != self._generation:
        return "drop"  # the test that asked for it is over: write nothing into the next
    if roll < self.error_rate:
      return status
    if roll < self.error_rate + self.drop_rate:
      return "drop"
    return None


class Server(http.server.ThreadingHTTPServer):
  daemon_threads = True
  # The listening socket is created before the port is reported, so no client ever
  # races the bind; a generous backlog absorbs TensorStore's parallel requests.
  request_queue_size = 128

  def __init__(self, address, store: Store, tls_context: ssl.SSLContext):
    super().__init__(address, Handler)
    self.store = store
    self.tls_context = tls_context
    self.faults = Faults()
    self._log: list[dict] = []
    self._log_lock = threading.Lock()

  def record(self, entry: dict) -> None:
    with self._log_lock:
      if len(self._log) < 100_000:
        self._log.append(entry)

  def log(self) -> list[dict]:
    with self._log_lock:
      return list(self._log)

  def clear_log(self) -> None:
    with self._log_lock:
      self._log.clear()


def make_tls_context(cert: str, key: str) -> ssl.SSLContext:
  context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  context.load_cert_chain(cert, key)
  # Only HTTP/1.1 is spoken here; without this a client offering h2 could still choose
  # HTTP/1.1, but saying so keeps any client from trying h2 prior knowledge.
  context.set_alpn_protocols(["http/1.1"])
  return context


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--bucket", action="append", required=True)
  parser.add_argument("--dir", required=True, help="where the certificates are written")
  parser.add_argument("--port", type=int, default=0)
  args = parser.parse_args()
  for bucket in args.bucket:
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]", bucket):
      parser.error(f"{bucket!r} is not a valid GCS bucket name")

  _, cert, key = write_certificates(args.dir)
  server = Server(("127.0.0.1", args.port), Store(args.bucket), make_tls_context(cert, key))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  sys.stdout.write(json.dumps({"port": server.server_address[1]}) + "\n")
  sys.stdout.flush()
  # Serve until the parent closes our stdin (stop(), or the parent died).
  sys.stdin.buffer.read()
  os._exit(0)  # daemon handler threads may be blocked in a read; do not wait for them


if __name__ == "__main__":
  main()
