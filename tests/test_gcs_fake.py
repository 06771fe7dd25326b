"""The local GCS fake (tests/helpers/gcs_fake.py) really stores what the project's GCS clients
write: tf.io.gfile, etils.epath's default backend, Orbax (TensorStore + epath), the
SentencePiece vocabulary cache, TFRecord reads and TFDS with data_dir on gs://.

Every test checks the bucket's content from outside the client, so it fails if the
client wrote anywhere else. Orbax, TFDS and the vocabulary's reader run in subprocesses
that inherit the fake's environment, as the project's commands would. tf.io.gfile reads
the environment at each request and google-cloud-storage when a Client is made, so their
tests run in this process; each test uses its own prefix, since TensorFlow caches what it
learnt of a path for 5 s and the bucket is emptied between tests.
"""

import hashlib
import http.client
import io
import json
import os
import subprocess
import sys
import textwrap
import urllib.parse

import numpy as np
import pytest
import tensorflow as tf
from etils import epath

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, *args: str, timeout: float = 240) -> str:
  """stdout of `code` run by a fresh interpreter with this process's environment."""
  result = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code), *args],
    cwd=REPO,
    timeout=timeout,
    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    capture_output=True,
    text=True,
  )
  assert result.returncode == 0, result.stderr[-6000:]
  return result.stdout


def tunnelled_hosts(fake) -> set[str]:
  """Hosts whose requests came through the HTTPS proxy: TensorFlow's built-in ones."""
  return {r["host"] for r in fake.requests() if r["tls"]}


# ----------------------------------------------------------------------------------
# tf.io.gfile and etils.epath


def test_tf_gfile_reads_and_writes_through_the_fake(gcs):
  root = f"{gcs.url}/gfile"
  tf.io.gfile.makedirs(f"{root}/a/b")
  assert tf.io.gfile.isdir(f"{root}/a/b")
  with tf.io.gfile.GFile(f"{root}/a/b/one.txt", "w") as f:
    f.write("first")
  with tf.io.gfile.GFile(f"{root}/a/two.bin", "wb") as f:
    f.write(bytes(range(256)) * 10)

  assert tf.io.gfile.exists(f"{root}/a/b/one.txt")
  assert not tf.io.gfile.exists(f"{root}/a/b/none.txt")
  with tf.io.gfile.GFile(f"{root}/a/b/one.txt") as f:
    assert f.read() == "first"
  with tf.io.gfile.GFile(f"{root}/a/two.bin", "rb") as f:
    f.seek(1000)  # a ranged read
    assert f.read(3) == bytes([1000 % 256, 1001 % 256, 1002 % 256])
  assert sorted(tf.io.gfile.listdir(f"{root}/a")) == ["b/", "two.bin"]
  assert tf.io.gfile.glob(f"{root}/a/*/*.txt") == [f"{root}/a/b/one.txt"]
  assert not tf.io.gfile.isdir(f"{root}/a/two.bin")

  tf.io.gfile.rename(f"{root}/a/b/one.txt", f"{root}/a/b/renamed.txt")
  tf.io.gfile.remove(f"{root}/a/two.bin")
  assert gcs.list_objects() == ["gfile/", "gfile/a/", "gfile/a/b/", "gfile/a/b/renamed.txt"]
  assert gcs.read("gfile/a/b/renamed.txt") == b"first"
  # TensorFlow reached its built-in endpoints, through the proxy.
  assert tunnelled_hosts(gcs) == {"www.googleapis.com", "storage.googleapis.com"}


def test_tf_gfile_rename_overwrites_like_the_vocabulary_cache(gcs):
  """tokenizer.save: write a temporary file, then rename it over the target."""
  path = f"{gcs.url}/cache/shared.model"
  tf.io.gfile.makedirs(f"{gcs.url}/cache")
  for content in (b"old", b"new"):
    with tf.io.gfile.GFile(f"{path}.tmp", "wb") as f:
      f.write(content)
    tf.io.gfile.rename(f"{path}.tmp", path, overwrite=True)
  assert gcs.list_objects() == ["cache/", "cache/shared.model"]
  assert gcs.read("cache/shared.model") == b"new"
  with tf.io.gfile.GFile(f"{path}.tmp", "wb") as f:
    f.write(b"newer")
  with pytest.raises(tf.errors.AlreadyExistsError):
    tf.io.gfile.rename(f"{path}.tmp", path, overwrite=False)
  assert gcs.read("cache/shared.model") == b"new"


def test_epath_default_backend_is_tf_gfile_and_uses_the_fake(gcs):
  root = epath.Path(f"{gcs.url}/epath")
  (root / "sub").mkdir(parents=True, exist_ok=True)
  (root / "sub" / "a.json").write_text('{"a": 1}')
  (root / "b.txt").write_bytes(b"bee")
  assert (root / "sub" / "a.json").exists()
  assert not (root / "missing").exists()
  assert (root / "sub" / "a.json").read_text() == '{"a": 1}'
  assert sorted(p.name for p in root.iterdir()) == ["b.txt", "sub"]
  assert (root / "sub").is_dir()

  assert gcs.list_objects() == ["epath/", "epath/b.txt", "epath/sub/", "epath/sub/a.json"]
  assert gcs.read("epath/b.txt") == b"bee"
  # Only TensorFlow's client goes through the proxy: epath used tf.io.gfile.
  assert tunnelled_hosts(gcs) == {"www.googleapis.com", "storage.googleapis.com"}
  root.rmtree()  # as Orbax deletes old checkpoints
  assert gcs.list_objects() == []


def test_google_cloud_storage_client_uses_the_fake(gcs):
  """Orbax asks google-cloud-storage whether a gs:// bucket has a hierarchical
  namespace before it lists checkpoints; the client honours STORAGE_EMULATOR_HOST."""
  from google.cloud import storage

  client = storage.Client()
  bucket = client.get_bucket(gcs.bucket)
  assert not bucket.hierarchical_namespace_enabled
  bucket.blob("gcs/small.txt").upload_from_string(b"alpha")  # a multipart upload
  content = np.random.default_rng(0).bytes(600 * 1024)
  # Of unknown size: a resumable upload, in chunks of 256 KiB.
  bucket.blob("gcs/big.bin", chunk_size=256 * 1024).upload_from_file(io.BytesIO(content))

  assert gcs.list_objects() == ["gcs/big.bin", "gcs/small.txt"]
  assert gcs.read("gcs/big.bin") == content
  assert [r["status"] for r in gcs.requests() if r["method"] == "PUT"] == [308, 308, 200]
  # Downloads are checked against the object's crc32c / md5.
  assert bucket.blob("gcs/small.txt").download_as_bytes() == b"alpha"
  assert bucket.blob("gcs/big.bin").download_as_bytes(start=1000, end=1009) == content[1000:1010]
  assert [b.name for b in client.list_blobs(gcs.bucket, prefix="gcs/")] == [
    "gcs/big.bin",
    "gcs/small.txt",
  ]
  bucket.blob("gcs/small.txt").delete()
  assert gcs.list_objects() == ["gcs/big.bin"]


# ----------------------------------------------------------------------------------
# Orbax


_ORBAX_COMMON = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DIRECTORY = sys.argv[1]
ITEMS = ("state", "data_iterator", "config")  # as transformer/training/checkpoints.py
mesh = Mesh(np.array(jax.devices()), ("data",))
sharded = NamedSharding(mesh, P("data"))
replicated = NamedSharding(mesh, P())

def state_at(step):
  # A small pytree: one array sharded over the 8 CPU devices (one TensorStore chunk
  # each), a bfloat16 and a scalar.
  return {"params": {"w": jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4) * step,
                                        sharded),
                     "b": jax.device_put(np.full((4,), step, jnp.bfloat16), replicated)},
          "step": jax.device_put(np.int32(step), replicated)}
"""


def test_orbax_checkpoint_manager_saves_and_restores_through_the_fake(gcs):
  directory = f"{gcs.url}/run/checkpoints"
  saved = run_python(
    _ORBAX_COMMON
    + """
options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                       enable_async_checkpointing=True)
epath.Path(DIRECTORY).mkdir(parents=True, exist_ok=True)
manager = ocp.CheckpointManager(DIRECTORY, options=options, item_names=ITEMS)
for step in (1, 2):  # the second save also deletes the first (max_to_keep=1)
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state_at(step)),
      data_iterator=ocp.args.JsonSave({"position": step}),
      config=ocp.args.JsonSave({"d_model": 8})), force=True)
manager.wait_until_finished()
manager.check_for_errors()
manager.close()
print(json.dumps(manager.all_steps()))
""",
    directory,
  )
  assert json.loads(saved.splitlines()[-1]) == [2]
  names = gcs.list_objects(prefix="run/checkpoints/")
  # Step 1 was deleted; step 2 is complete (on GCS Orbax writes in place and marks a
  # finished checkpoint with commit_success.txt instead of renaming a tmp directory).
  assert {n.split("/")[2] for n in names} == {"", "2"}, names
  step = "run/checkpoints/2/"
  for name in [
    "commit_success.txt",
    "state/manifest.ocdbt",
    "state/_METADATA",
    "data_iterator/metadata",
    "config/metadata",
  ]:
    assert step + name in names, names
  # TensorStore's OCDBT data files: the array chunks.
  assert [n for n in names if n.startswith(step + "state/ocdbt.process_0/d/")], names
  assert json.loads(gcs.read("run/checkpoints/2/data_iterator/metadata")) == {"position": 2}
  # TensorStore wrote the arrays over plain HTTP (TENSORSTORE_GCS_HTTP_URL), with
  # conditional uploads.
  plain_uploads = [
    r for r in gcs.requests() if not r["tls"] and r["path"].startswith("/upload/storage/v1/")
  ]
  assert plain_uploads

  restored = run_python(
    _ORBAX_COMMON
    + """
manager = ocp.CheckpointManager(DIRECTORY, item_names=ITEMS)
step = manager.latest_step()
abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state_at(0))
restored = manager.restore(step, args=ocp.args.Composite(
    state=ocp.args.StandardRestore(abstract), data_iterator=ocp.args.JsonRestore()))
manager.close()
state = restored["state"]
print(json.dumps({"steps": manager.all_steps(), "step": step,
                  "w": np.asarray(state["params"]["w"]).tolist(),
                  "b": np.asarray(state["params"]["b"], np.float32).tolist(),
                  "w_sharded": state["params"]["w"].sharding.spec == P("data"),
                  "scalar": int(state["step"]), "iterator": restored["data_iterator"]}))
""",
    directory,
  )
  result = json.loads(restored.splitlines()[-1])
  assert result["steps"] == [2] and result["step"] == 2
  np.testing.assert_array_equal(result["w"], np.arange(32).reshape(8, 4) * 2)
  assert result["b"] == [2.0] * 4 and result["scalar"] == 2
  assert result["w_sharded"]
  assert result["iterator"] == {"position": 2}


# ----------------------------------------------------------------------------------
# The vocabulary cache, TFRecords, TFDS


def test_sentencepiece_model_saved_and_loaded_through_the_fake(gcs):
  from transformer.data import tokenizer as tokenizer_lib

  sentences = [
    f"the {w} sat on the mat number {i}"
    for i, w in enumerate(["cat", "dog", "bird", "fish", "cow"] * 20)
  ]
  trained = tokenizer_lib.train_tokenizer(iter(sentences), vocab_size=60, vocab_type="bpe")
  path = f"{gcs.url}/vocab/shared.model"
  trained.save(path)  # tf.io.gfile: makedirs, write a temporary file, rename it

  assert gcs.list_objects() == ["vocab/", "vocab/shared.model"]
  assert gcs.read("vocab/shared.model") == trained.model_proto
  loaded = run_python(
    """
import hashlib, json, sys
from transformer.data import tokenizer as tokenizer_lib
tokenizer = tokenizer_lib.Tokenizer.load(sys.argv[1])
print(json.dumps([hashlib.sha256(tokenizer.model_proto).hexdigest(),
                  tokenizer.encode("the cat sat on the mat")]))
""",
    path,
  )
  digest, ids = json.loads(loaded.splitlines()[-1])
  assert digest == hashlib.sha256(trained.model_proto).hexdigest()
  assert ids == trained.encode("the cat sat on the mat")


def test_tfrecord_dataset_reads_from_the_fake(gcs):
  path = f"{gcs.url}/records/data.tfrecord"
  records = [f"record {i}".encode() * (i + 1) for i in range(50)]
  with tf.io.TFRecordWriter(path) as writer:
    for record in records:
      writer.write(record)
  assert gcs.list_objects() == ["records/data.tfrecord"]
  read = [r.numpy() for r in tf.data.TFRecordDataset([path])]
  assert read == records
  # The records came from the bucket: a ranged XML API read of this object.
  reads = [
    r
    for r in gcs.requests()
    if r["method"] == "GET" and r["path"] == "/test-bucket/records%2Fdata.tfrecord"
  ]
  assert reads and all(r["tls"] and r["host"] == "storage.googleapis.com" for r in reads)


def test_tfds_builder_reads_a_prepared_dataset_from_the_fake(gcs, tmp_path):
  """As tensorflow-datasets does with data_dir=gs://...: the dataset is prepared locally
  (no network: its examples are generated), copied into the bucket, and read back by a
  builder that only knows the gs:// data_dir."""
  data_dir = f"{gcs.url}/tfds"
  out = run_python(
    """
import json, os, sys
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

class GcsFakeTiny(tfds.core.GeneratorBasedBuilder):
  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {"en": tfds.features.Text(), "id": np.int64}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(40), "test": self._generate_examples(5)}

  def _generate_examples(self, n):
    for i in range(n):
      yield i, {"en": f"sentence {i}", "id": i}

local, remote = sys.argv[1], sys.argv[2]
GcsFakeTiny(data_dir=local).download_and_prepare()
for directory, _, files in tf.io.gfile.walk(local):
  target = remote + directory[len(local):]
  tf.io.gfile.makedirs(target)
  for name in files:
    tf.io.gfile.copy(os.path.join(directory, name), f"{target}/{name}")
tf.io.gfile.rmtree(local)

builder = tfds.builder("gcs_fake_tiny", data_dir=remote)
assert builder.data_dir.startswith("gs://"), builder.data_dir
read_config = tfds.ReadConfig(shuffle_seed=0, try_autocache=False)
examples = tfds.as_numpy(builder.as_dataset(split="train", read_config=read_config))
print(json.dumps(sorted((int(ex["id"]), ex["en"].decode()) for ex in examples)))
""",
    str(tmp_path / "tfds"),
    data_dir,
  )
  assert json.loads(out.splitlines()[-1]) == [[i, f"sentence {i}"] for i in range(40)]
  names = gcs.list_objects()
  prefix = "tfds/gcs_fake_tiny/1.0.0/"
  assert f"{prefix}dataset_info.json" in names, names
  assert any(n.startswith(f"{prefix}gcs_fake_tiny-train.tfrecord") for n in names), names


# ----------------------------------------------------------------------------------
# The fake itself


def _http(fake, method, path, body=b"", headers=None):
  connection = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=30)
  try:
    connection.request(method, path, body=body, headers=headers or {})
    response = connection.getresponse()
    return response.status, dict(response.getheaders()), response.read()
  finally:
    connection.close()


def test_fake_honours_generation_preconditions_as_tensorstore_needs(gcs):
  upload = "/upload/storage/v1/b/test-bucket/o?uploadType=media&name=k"
  status, _, body = _http(gcs, "POST", upload + "&ifGenerationMatch=0", b"v1")
  assert status == 200
  first = int(json.loads(body)["generation"])
  assert _http(gcs, "POST", upload + "&ifGenerationMatch=0", b"v2")[0] == 412
  status, _, body = _http(gcs, "POST", upload + f"&ifGenerationMatch={first}", b"v2")
  assert status == 200 and int(json.loads(body)["generation"]) > first
  assert _http(gcs, "POST", upload + f"&ifGenerationMatch={first}", b"v3")[0] == 412

  media = "/storage/v1/b/test-bucket/o/k?alt=media"
  status, headers, body = _http(gcs, "GET", media)
  second = int(headers["x-goog-generation"])
  assert (status, body) == (200, b"v2") and second > first
  assert _http(gcs, "GET", media + f"&ifGenerationNotMatch={second}")[0] == 304
  assert _http(gcs, "GET", media + f"&ifGenerationMatch={first}")[0] == 412
  assert _http(gcs, "DELETE", f"/storage/v1/b/test-bucket/o/k?ifGenerationMatch={first}")[0] == 412
  assert _http(gcs, "DELETE", f"/storage/v1/b/test-bucket/o/k?ifGenerationMatch={second}")[0] == 204
  assert gcs.list_objects() == []


def test_fake_ranges_uploads_and_listing_pages(gcs):
  status, _, body = _http(
    gcs, "POST", "/upload/storage/v1/b/test-bucket/o?uploadType=media&name=d%2F"
  )
  assert status == 200 and json.loads(body)["size"] == "0"  # an empty directory marker
  boundary = "b0undary"
  multipart = (
    f"--{boundary}\r\nContent-Type: application/json\r\n\r\n"
    '{"name": "d/m.txt", "metadata": {"k": "v"}}\r\n'
    f"--{boundary}\r\nContent-Type: text/plain\r\n\r\n0123456789\r\n"
    f"--{boundary}--\r\n"
  ).encode()
  status, _, body = _http(
    gcs,
    "POST",
    "/upload/storage/v1/b/test-bucket/o?uploadType=multipart",
    multipart,
    {"Content-Type": f"multipart/related; boundary={boundary}"},
  )
  assert status == 200 and json.loads(body)["metadata"] == {"k": "v"}
  assert gcs.read("d/m.txt") == b"0123456789"

  xml = "/test-bucket/d%2Fm.txt"
  assert _http(gcs, "GET", xml, headers={"Range": "bytes=-3"})[2] == b"789"
  status, headers, body = _http(gcs, "GET", xml, headers={"Range": "bytes=4-"})
  assert (status, body, headers["Content-Range"]) == (206, b"456789", "bytes 4-9/10")
  assert _http(gcs, "GET", xml, headers={"Range": "bytes=10-20"})[0] == 416

  for name in ["d/x/1", "d/x/2", "d/y/1", "d/z", "e"]:
    quoted = urllib.parse.quote(name, safe="")
    _http(gcs, "POST", f"/upload/storage/v1/b/test-bucket/o?uploadType=media&name={quoted}", b"-")
  items, prefixes, token = [], [], ""
  while True:  # one entry a page: the page token must resume after a prefix
    query = "prefix=d%2F&delimiter=%2F&maxResults=1" + (f"&pageToken={token}" if token else "")
    page = json.loads(_http(gcs, "GET", f"/storage/v1/b/test-bucket/o?{query}")[2])
    items += [i["name"] for i in page.get("items", [])]
    prefixes += page.get("prefixes", [])
    token = page.get("nextPageToken", "")
    if not token:
      break
  assert items == ["d/", "d/m.txt", "d/z"] and prefixes == ["d/x/", "d/y/"]
  page = json.loads(
    _http(gcs, "GET", "/storage/v1/b/test-bucket/o?startOffset=d%2Fx&endOffset=d%2Fz")[2]
  )
  assert [i["name"] for i in page["items"]] == ["d/x/1", "d/x/2", "d/y/1"]


def test_fake_proxies_nothing_but_gcs(gcs):
  connection = http.client.HTTPConnection("127.0.0.1", gcs.port, timeout=30)
  connection.request("CONNECT", "example.com:443")
  assert connection.getresponse().status == 403
  connection.close()
  assert _http(gcs, "GET", "/storage/v1/b/other-bucket/o")[0] == 404
  assert _http(gcs, "GET", "/computeMetadata/v1/project/project-id")[0] == 404
