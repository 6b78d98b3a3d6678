"""`maxtrain prepare --engine ray` on a real local Ray cluster (`ray start --head`, 2 CPUs, token
authentication on, as a user's cluster would have it): the output equals the local engine's byte for
byte, a killed driver's prepare resumes (on disk and in an S3 bucket), and a changed rerun is refused."""

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from maxtrain import cli, storage
from maxtrain.config import ConfigError
from maxtrain.data.prepare import _is_val, prepare, val_mask
from maxtrain.data.prepare_ray import PLAN, WORK, make_pieces, prepare_ray, range_lines
from maxtrain.data.tokenizers import train_bpe
from s3server import BUCKET
from test_object_store import s3  # noqa: F401  (the module's S3 server fixture)

# Ray reads its authentication settings when first imported: the test cluster's token is set first
# (for this test process, the cluster and the drivers it starts).
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.environ.get("MAXTRAIN_TEST_RAY_TOKEN") or secrets.token_hex(16)}
os.environ.update(AUTH)
os.environ["MAXTRAIN_TEST_RAY_TOKEN"] = AUTH["RAY_AUTH_TOKEN"]
pytest.importorskip("ray")

PIECE_MIB = 2 / 1024  # 2 KiB pieces: a small corpus still makes many, and lines cross their edges


def _corpus(root):
    """Files of each kind, with what the readers must get right: blank and whitespace-only JSONL
    lines, CRLF and CR, long lines crossing many pieces, non-ASCII text, a nested directory."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "δέλτα", "ε", "日本語", "tab\tbed", "cr\r\nlf"]
    root.mkdir(parents=True, exist_ok=True)
    (root / "sub").mkdir(exist_ok=True)
    lines = []
    for i in range(300):
        long = " " + "x" * 5000 if i % 50 == 7 else ""  # crosses several pieces
        lines.append(json.dumps({"text": f"{i} " + " ".join(rng.choice(words, rng.integers(1, 30))) + long,
                                 "id": i}, ensure_ascii=bool(i % 2)))
        if i % 23 == 0:
            lines.append("   " if i % 2 else "\u3000")  # skipped, as the local engine skips them
    (root / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": "b" * int(n)}) + "\n"
                                                  for n in rng.integers(1, 3000, 8)))
    (root / "c.txt").write_bytes("plain\r\ntext\rfile é\n".encode())
    (root / "d.jsonl").write_text(json.dumps({"text": "no final newline"}))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["pq one", "", None, "pq two " * 50]}), root / "e.parquet")
    return root


def _files(path):
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(path) for f in fs}


def _assert_identical(a, b):
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], name


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A Ray head on 127.0.0.1 with 2 CPUs and token authentication (AUTH); yields its address."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    temp = f"/tmp/ray-mt-{os.getpid()}"  # short: Ray's unix sockets live under it
    proc = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block", "--num-cpus", "2", "--port", str(port), "--node-ip-address",
         "127.0.0.1", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp],
        env={**os.environ, **AUTH}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        from maxtrain.data.prepare_ray import address_problem

        deadline = time.monotonic() + 180  # `ray start` takes a while on a loaded machine
        while address_problem(f"127.0.0.1:{port}", timeout=1.0):
            assert proc.poll() is None, f"ray start exited {proc.returncode}"
            assert time.monotonic() < deadline, "the Ray head did not come up in 180 s"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # `ray start --block` stops its processes on an interrupt
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", temp], check=False)  # any worker that outlived the head
        import shutil

        shutil.rmtree(temp, ignore_errors=True)


def _local(corpus, out, **kw):
    return prepare(str(corpus), str(out), kw.pop("tokenizer", "byte"), workers=1, **kw)


def _ray(corpus, out, address, **kw):
    return prepare_ray(str(corpus), str(out), kw.pop("tokenizer", "byte"), ray_address=address,
                       piece_bytes=int(PIECE_MIB * 2**20), **kw)


# ---------------------------------------------------------------- the rule's parts, without a cluster


def test_val_mask_is_the_scalar_rule():
    for first, fraction, seed in ((0, 0.2, 0), (2**40 - 7, 0.5, 3), (12345, 0.01, 2**63 + 5)):
        expected = [_is_val(n, fraction, seed) for n in range(first, first + 2000)]
        assert val_mask(first, 2000, fraction, seed).tolist() == expected
    assert not val_mask(0, 100, 0.0, 0).any()


def test_byte_ranges_give_every_line_once(tmp_path):
    """Cut at every piece size, the pieces' lines are the file's lines, each once, in order."""
    path = tmp_path / "x.jsonl"
    data = b"a\n\nbb\nccc\r\n" + b"d" * 40 + b"\n\n\nlast-no-newline"
    path.write_bytes(data)
    whole = [(o, raw) for o, _, raw in range_lines(str(path), 0, len(data), len(data))]
    assert b"".join(r for _, r in whole) == data and len(whole) == data.count(b"\n") + 1
    for size in range(1, len(data) + 2):
        files = [{"path": str(path), "size": len(data)}]
        got = [(o, raw) for p in make_pieces(files, size) for o, _, raw in range_lines(str(path), p["start"], p["end"],
                                                                                       p["size"])]
        assert got == whole, size


def test_what_ray_cannot_do_is_refused_in_one_line(tmp_path, capsys):
    corpus = str(_corpus(tmp_path / "in"))
    with pytest.raises(ConfigError, match="train it on a sample first"):
        prepare_ray(corpus, str(tmp_path / "out"), train_tokenizer=300)
    with pytest.raises(ConfigError, match="leave --workers out"):
        prepare_ray(corpus, str(tmp_path / "out"), ray_address="127.0.0.1:6379", workers=2)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # a port nothing listens on (Ray would retry it for minutes)
    dead = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    code = cli.main(["prepare", "--input", corpus, "--output", str(tmp_path / "out"), "--engine", "ray",
                     "--ray-address", dead])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("maxtrain: error:")]
    assert code == 2 and len(err) == 1 and f"--ray-address {dead}: nothing answers there" in err[0], err
    code = cli.main(["prepare", "--input", corpus, "--output", str(tmp_path / "out"), "--piece-mib", "1"])
    assert code == 2 and "apply to --engine ray" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.partial-ray")


# ---------------------------------------------------------------- on the cluster


def test_ray_output_equals_local_byte_for_byte(tmp_path, ray_cluster):
    corpus = _corpus(tmp_path / "in")
    _local(corpus, tmp_path / "local", shards=3, val_fraction=0.2, seed=7)
    m = _ray(corpus, tmp_path / "ray", ray_cluster, shards=3, val_fraction=0.2, seed=7)
    assert len(make_pieces([{"path": str(corpus / "a.jsonl"), "size": (corpus / "a.jsonl").stat().st_size}],
                           int(PIECE_MIB * 2**20))) > 20
    assert m["resumed"] == {"pieces": 0, "shards": 0}
    _assert_identical(tmp_path / "local", tmp_path / "ray")
    assert not os.path.exists(f"{tmp_path / 'ray'}.partial-ray")
    # a trained BPE (uint16 ids; the tokenizer file shipped to the workers and copied beside the shards)
    tok = tmp_path / "tok"
    prepare(str(corpus), str(tok), train_tokenizer=400, workers=1)
    _local(corpus, tmp_path / "local-bpe", tokenizer=str(tok / "tokenizer.json"), shards=2)
    _ray(corpus, tmp_path / "ray-bpe", ray_cluster, tokenizer=str(tok / "tokenizer.json"), shards=2)
    _assert_identical(tmp_path / "local-bpe", tmp_path / "ray-bpe")


def test_bad_line_is_one_clear_error(tmp_path, ray_cluster, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    code = cli.main(["prepare", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                     "--engine", "ray", "--ray-address", ray_cluster])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("maxtrain: error:")]
    assert code == 2 and len(err) == 1 and "x.jsonl byte 17: not a JSON object with a 'text' string" in err[0], err
    assert not os.path.exists(tmp_path / "out")


def _driver(corpus, out, address, env=None):
    """`maxtrain prepare --engine ray` as its own process (the driver a test kills)."""
    return subprocess.Popen([sys.executable, "-m", "maxtrain.cli", "prepare", "--input", str(corpus), "--output",
                             str(out), "--shards", "3", "--val-fraction", "0.2", "--engine", "ray", "--ray-address",
                             address, "--piece-mib", str(PIECE_MIB)], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _kill_when(proc, ready, timeout=120):
    """SIGKILL `proc` as soon as `ready()` holds; returns what `ready()` returned then."""
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        assert proc.poll() is None, f"the driver ended before it could be killed: {proc.stdout.read()[-2000:]}"
        assert time.monotonic() < deadline, "no piece was tokenized in time"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return found


def _valid_pieces(listing_sizes, read_marker):
    """Pieces whose marker is there with files of the sizes it names."""
    valid = []
    for name in listing_sizes:
        if name.endswith(".json"):
            m = read_marker(name)
            stem = name[:-5]
            if m and listing_sizes.get(stem + ".tokens") == m["tokens_bytes"] and \
                    listing_sizes.get(stem + ".lengths") == m["lengths_bytes"]:
                valid.append(stem)
    return sorted(valid)


def test_killed_driver_resumes_redoing_only_unfinished_work(tmp_path, ray_cluster):
    corpus = _corpus(tmp_path / "in")
    _local(corpus, tmp_path / "local", shards=3, val_fraction=0.2)
    out = tmp_path / "out"
    partial = tmp_path / "out.partial-ray"
    pieces_dir = partial / WORK / "pieces"

    def some_done():
        return os.path.isdir(pieces_dir) and [n for n in os.listdir(pieces_dir) if n.endswith(".json")]

    _kill_when(_driver(corpus, out, ray_cluster), some_done)
    assert not out.exists() and (partial / PLAN).is_file()

    def sizes():
        return {n: os.path.getsize(pieces_dir / n) for n in os.listdir(pieces_dir)}

    time.sleep(1.0)  # the killed job's tasks still running end or are stopped by Ray
    valid = _valid_pieces(sizes(), lambda n: json.loads((pieces_dir / n).read_text()))
    assert valid
    # a rerun that differs is refused, naming what changed, and leaves the partial output alone
    with pytest.raises(ConfigError, match=r"--shards 3 -> 4"):
        _ray(corpus, out, ray_cluster, shards=4, val_fraction=0.2)
    other = train_bpe(["another tokenizer"] * 20, 280, str(tmp_path / "other" / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"the tokenizer differ"):
        _ray(corpus, out, ray_cluster, shards=3, val_fraction=0.2, tokenizer=other.spec)
    a = corpus / "a.jsonl"
    original, stat = a.read_bytes(), a.stat()
    a.write_bytes(original.replace(b"alpha", b"ALPHA", 1))
    with pytest.raises(ConfigError, match=r"the input \(a.jsonl\)"):
        _ray(corpus, out, ray_cluster, shards=3, val_fraction=0.2)
    a.write_bytes(original)
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # half-written work, as a kill at another moment leaves it: a piece file cut short behind its
    # marker, a shard written without its marker, a writer's temporary file
    cut = valid[0]
    with open(pieces_dir / f"{cut}.tokens", "r+b") as f:
        f.truncate(max(0, os.path.getsize(pieces_dir / f"{cut}.tokens") - 3))
    (partial / "train-00001-of-00003.arrayrecord").write_bytes(b"half a shard")
    (partial / "train-00001-of-00003.lengths.npy.tmp-999").write_bytes(b"x")
    kept = len(_valid_pieces(sizes(), lambda n: json.loads((pieces_dir / n).read_text())))
    total = len(json.loads((partial / PLAN).read_text())["pieces"])
    m = _ray(corpus, out, ray_cluster, shards=3, val_fraction=0.2)
    # (a task of the killed job that was still running may have finished a piece since)
    assert kept <= m["resumed"]["pieces"] < total and m["resumed"]["shards"] == 0
    _assert_identical(tmp_path / "local", out)
    assert not partial.exists()


def test_s3_input_and_output_resume_after_a_killed_driver(tmp_path, ray_cluster, s3):
    """Input read by byte ranges from the bucket, shards written into it (no rename there): a killed
    driver's half-written shard and cut-short piece are found by their markers and written again."""
    corpus = _corpus(tmp_path / "in")
    _local(corpus, tmp_path / "local", shards=3, val_fraction=0.2)
    raw, url = f"s3://{BUCKET}/raw", f"s3://{BUCKET}/tokens"
    storage.publish(str(corpus), raw)
    pieces = storage.join(url, WORK, "pieces")

    def some_done():
        return [o["key"] for o in storage.list_objects(pieces) if o["key"].endswith(".json")]

    _kill_when(_driver(raw, url, ray_cluster, env=s3.env), some_done)
    time.sleep(1.0)
    assert not storage.exists(storage.join(url, "manifest.json"))
    with pytest.raises(ConfigError, match=r"--val-fraction 0.2 -> 0.1"):
        _ray(raw, url, ray_cluster, shards=3, val_fraction=0.1)

    def sizes():
        return {o["key"]: o["size"] for o in storage.list_objects(pieces)}

    valid = _valid_pieces(sizes(), lambda n: json.loads(storage.read_bytes(storage.join(pieces, n))))
    assert valid
    key = storage.join(pieces, f"{valid[0]}.tokens")
    storage.write_bytes(key, storage.read_bytes(key)[:-2])  # the piece's object cut short
    storage.write_bytes(storage.join(url, "val-00000-of-00001.arrayrecord"), b"half a shard")
    # a shard whose marker is there but whose file is shorter than it says (put again, cut short)
    storage.write_bytes(storage.join(url, "train-00002-of-00003.arrayrecord"), b"twelve bytes")
    storage.write_bytes(storage.join(url, "train-00002-of-00003.lengths.npy"), b"12345")
    storage.write_bytes(storage.join(url, WORK, "shards", "train-00002-of-00003.json"),
                        json.dumps({"entry": {"file": "train-00002-of-00003.arrayrecord",
                                              "lengths_file": "train-00002-of-00003.lengths.npy"},
                                    "bytes": 13, "lengths_bytes": 5}).encode())
    kept = len(_valid_pieces(sizes(), lambda n: json.loads(storage.read_bytes(storage.join(pieces, n)))))
    m = _ray(raw, url, ray_cluster, shards=3, val_fraction=0.2)
    assert kept <= m["resumed"]["pieces"] and m["resumed"]["shards"] == 0
    assert not storage.list_objects(storage.join(url, WORK))
    storage.stage(url, str(tmp_path / "cache"))
    _assert_identical(tmp_path / "local", storage.cache_path(url, str(tmp_path / "cache")))
    with pytest.raises(ConfigError, match="already holds a prepared dataset"):
        _ray(raw, url, ray_cluster, shards=3, val_fraction=0.2)
