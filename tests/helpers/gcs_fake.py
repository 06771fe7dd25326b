"""A local Google Cloud Storage for tests: `gs://` paths without network or credentials.

  from tests.helpers.gcs_fake import gcs, gcs_server  # noqa: F401  (pytest fixtures)

  def test_something(gcs):
    run(["python", "train.py", "--workdir", f"{gcs.url}/run"], env={**os.environ})
    assert "run/config.json" in gcs.list_objects()

or, outside pytest, `with start_gcs() as fake: ... fake.env ...`.

The bucket lives in memory in a child process (tests/helpers/gcs_fake_server.py) listening on a
free port of 127.0.0.1. `env` points every GCS client the project uses at it:
TensorFlow's GCS filesystem (tf.io.gfile, so also etils.epath's default backend on gs://,
TFDS and the vocabulary cache), TensorStore (Orbax's array writer) and
google-cloud-storage (which Orbax calls on gs:// too). See `_environment` for why each
variable is there.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest

_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcs_fake_server.py")
CONTROL_HEADER = "X-Gcs-Fake-Control"  # gcs_fake_server.CONTROL_HEADER: never failed
_START_TIMEOUT_S = 60.0

# The token TensorFlow and TensorStore send; the fake accepts any.
FAKE_TOKEN = "gcs-fake-token"


def _environment(port: int, ca_bundle: str) -> dict[str, str]:
  """The variables that send a process's GCS traffic to the fake on `port`."""
  local = f"127.0.0.1:{port}"
  # Traffic to this machine must not go through the proxy: TensorStore's plain-HTTP
  # endpoint below, and the jax.distributed coordinator (jaxlib's gRPC reads https_proxy
  # and no_proxy too).
  no_proxy = ["127.0.0.1", "localhost", "::1", socket.gethostname()]
  for existing in (os.environ.get("no_proxy"), os.environ.get("NO_PROXY")):
    no_proxy += [h for h in (existing or "").split(",") if h and h not in no_proxy]
  return {
    # TensorFlow's GCS filesystem has https://www.googleapis.com and
    # https://storage.googleapis.com built in; its libcurl honours the proxy
    # variables, so those requests are tunnelled to the fake, which terminates TLS.
    # libcurl reads the lower-case name first; some tools only know the upper case.
    "https_proxy": f"http://{local}",
    "HTTPS_PROXY": f"http://{local}",
    "no_proxy": ",".join(no_proxy),
    "NO_PROXY": ",".join(no_proxy),
    # ...and trusts the fake's certificate: TensorFlow passes this file to libcurl as
    # its only CA bundle. (Python's requests reads it too; the proxy refuses every
    # host but GCS anyway.)
    "CURL_CA_BUNDLE": ca_bundle,
    # TensorFlow and TensorStore take this as the OAuth token instead of looking for
    # credentials (gcloud files, GOOGLE_APPLICATION_CREDENTIALS, the metadata server).
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": FAKE_TOKEN,
    # TensorStore's GCS driver (Orbax's arrays) talks to this base URL instead of
    # https://storage.googleapis.com, in plain HTTP, bypassing the proxy (no_proxy).
    "TENSORSTORE_GCS_HTTP_URL": f"http://{local}",
    # google-cloud-storage uses this endpoint with anonymous credentials: Orbax asks it
    # whether a gs:// bucket has a hierarchical namespace. gcsfs (etils.epath's backend
    # with EPATH_USE_TF=false) reads it too; it is not installed here, so untested.
    "STORAGE_EMULATOR_HOST": f"http://{local}",
    # Anything still looking for credentials must not probe the GCE metadata server:
    # google-auth skips it with NO_GCE_CHECK, and the metadata host variables
    # (TensorFlow, google-auth: GCE_METADATA_HOST; TensorStore: GCE_METADATA_ROOT;
    # google-auth: GCE_METADATA_IP) point at the fake, which answers 404 at once
    # instead of a connection to 169.254.169.254 that hangs until a timeout.
    "NO_GCE_CHECK": "true",
    "GCE_METADATA_HOST": local,
    "GCE_METADATA_ROOT": local,
    "GCE_METADATA_IP": local,
    # TensorFlow retries a failed GCS request 10 times, backing off from 1 s to 32 s:
    # a request the fake cannot serve would stall a test for minutes. 10 ms to 100 ms
    # makes it fail in about a second with the same error.
    "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "10000",
    "GCS_RETRY_CONFIG_MAX_DELAY_TIME_US": "100000",
  }


class FakeGcs:
  """A running fake: one bucket in a child process. Stop it with `stop()` (or `with`)."""

  def __init__(self, bucket: str = "test-bucket"):
    self.bucket = bucket
    self.url = f"gs://{bucket}"
    self._dir = tempfile.mkdtemp(prefix="gcs-fake-")
    self._log_file = open(os.path.join(self._dir, "server.log"), "wb")  # noqa: SIM115 (the server writes it until stop())
    # Its own session: a Ctrl-C aimed at pytest does not reach it first, and stop()
    # or the parent's exit (stdin closes) ends it.
    self._process = subprocess.Popen(
      [sys.executable, _SERVER, "--bucket", bucket, "--dir", self._dir],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self._log_file,
      start_new_session=True,
    )
    try:
      self.port = self._wait_for_port()
    except BaseException:
      self.stop()
      raise
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self.ca_bundle = os.path.join(self._dir, "ca.pem")
    self.env = _environment(self.port, self.ca_bundle)
    # The test process's own requests (list_objects, read) go straight to the fake,
    # whatever proxy the environment names.
    self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

  def _wait_for_port(self) -> int:
    ready, _, _ = select.select([self._process.stdout], [], [], _START_TIMEOUT_S)
    line = self._process.stdout.readline() if ready else b""
    if not line:
      raise RuntimeError(f"the GCS fake did not start:\n{self.server_log()}")
    return int(json.loads(line)["port"])

  def server_log(self) -> str:
    """What the server wrote to stderr: failed TLS handshakes, internal errors."""
    self._log_file.flush()
    with open(self._log_file.name, "rb") as f:
      return f.read().decode(errors="replace")

  # ---- the bucket, as the test sees it ----------------------------------------

  def _request(
    self, method: str, path: str, query: dict | None = None, data: bytes | None = None
  ) -> bytes:
    url = self.endpoint + path
    if query:
      url += "?" + urllib.parse.urlencode(query)
    request = urllib.request.Request(
      url,
      method=method,
      headers={CONTROL_HEADER: "1"},
      data=data if data is not None else (b"" if method == "POST" else None),
    )
    with self._opener.open(request, timeout=30) as response:
      return response.read()

  def list_objects(self, prefix: str = "") -> list[str]:
    """Sorted names of the objects in the bucket (directory markers `x/` included)."""
    names, token = [], None
    while True:
      query = {"prefix": prefix, **({"pageToken": token} if token else {})}
      page = json.loads(self._request("GET", f"/storage/v1/b/{self.bucket}/o", query))
      names += [item["name"] for item in page.get("items", [])]
      token = page.get("nextPageToken")
      if not token:
        return sorted(names)

  def read(self, name: str) -> bytes:
    """The content of object `name`; FileNotFoundError if there is none."""
    quoted = urllib.parse.quote(name, safe="")
    try:
      return self._request("GET", f"/storage/v1/b/{self.bucket}/o/{quoted}", {"alt": "media"})
    except urllib.error.HTTPError as e:
      if e.code == 404:
        raise FileNotFoundError(f"{self.url}/{name}") from None
      raise

  def requests(self) -> list[dict]:
    """Every request served since the start or `reset()`: method, host, path (without
    the query), status ("-" for a dropped connection), tls (whether it came through the
    HTTPS proxy), bytes (of the request's body), object (the name it is about, where
    known) and fault ("error", "drop" or "")."""
    return json.loads(self._request("GET", "/_fake/log"))

  def uploaded_bytes(self, object_prefix: str = "") -> int:
    """Request body bytes sent for objects whose name starts with `object_prefix`."""
    return sum(
      r["bytes"]
      for r in self.requests()
      if r["object"].startswith(object_prefix) and r["method"] in ("POST", "PUT")
    )

  def set_faults(self, **faults) -> None:
    """Makes the server misbehave from now on (see gcs_fake_server.Faults): error_rate
    and statuses (429, 503), drop_rate, stall_s with stall_match and stall_count, seed.
    `set_faults()` heals it; `reset()` does too. The test's own requests here (read,
    list_objects) are never failed."""
    self._request("POST", "/_fake/faults", data=json.dumps(faults).encode())

  def reset(self) -> None:
    """Empties the bucket and the request log, and stops any faults."""
    self._request("POST", "/_fake/reset")

  # ---- lifetime ---------------------------------------------------------------

  def stop(self) -> None:
    if self._process.poll() is None:
      with contextlib.suppress(OSError):
        self._process.stdin.close()  # the server exits when its stdin closes
      try:
        self._process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._process.wait()
    for stream in (self._process.stdin, self._process.stdout):
      with contextlib.suppress(OSError):
        stream.close()
    self._log_file.close()
    shutil.rmtree(self._dir, ignore_errors=True)

  def __enter__(self) -> FakeGcs:
    return self

  def __exit__(self, *exc_info) -> None:
    self.stop()


def start_gcs(bucket: str = "test-bucket") -> FakeGcs:
  """Starts a fake holding the empty bucket `bucket`; a context manager that stops it.

  Each call gets its own process and port, so pytest-xdist workers do not share one.
  """
  return FakeGcs(bucket)


@contextlib.contextmanager
def environment(fake: FakeGcs) -> Iterator[None]:
  """os.environ pointed at `fake` for the duration, then restored as it was.

  Child processes started meanwhile inherit it. In this process TensorFlow reads the
  proxy, CA and token variables at each request, but its retry settings only once, when
  it sets up its GCS filesystem; TensorStore reads its URL when it opens a kvstore and
  google-cloud-storage when a Client is made.
  """
  saved = {k: os.environ.get(k) for k in fake.env}
  os.environ.update(fake.env)
  try:
    yield
  finally:
    for key, value in saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGcs]:
  """One fake for the session (per xdist worker); prefer `gcs`, which empties it."""
  with start_gcs() as fake:
    yield fake


@pytest.fixture
def gcs(gcs_server: FakeGcs) -> Iterator[FakeGcs]:
  """The session's fake with an empty bucket, and os.environ pointing at it for the test
  (so subprocesses started with the default environment use it too).

  TensorFlow in this process caches a path's stat (exists, isdir) for 5 s across tests:
  give each test its own prefix rather than reuse one an earlier test created.
  """
  gcs_server.reset()
  with environment(gcs_server):
    yield gcs_server
