"""Checkpoints written by the trainer before issue 41's refactor (tests/fixtures/checkpoints/, written by
tests/fixtures/make_checkpoints.py; the commit is in each case's expected.json) still resume, and the two
steps after the saved one equal the uninterrupted run's: plain llama, delayed FP8 (its amax histories),
1F1B pipeline, DeepSeek with its balancing bias, and a step that only the local tier holds.

Each case is copied to tmp_path and resumed with `maxtrain.train(load_config(configs/tiny.yaml, overrides))`,
the overrides stored in its expected.json (not conftest's SMALL, which may change) plus the copied paths:
`run_dir`, `checkpoint.dir=<tmp>/ck` and, for the local tier, `checkpoint.local.dir=<tmp>/local`.
The local tier finds a run's steps under `<checkpoint.local.dir>/<run_key(checkpoint.dir)>/p<process>/`,
and `run_key` hashes the absolute path of checkpoint.dir: the fixture stores `local/p0/` (the run key
left out), and `_lay_out` moves it to `local/<run_key(str(tmp_path / 'ck'))>/p0/` of the copy.

The numbers are keyed by machine (jaxlib, CPU architecture and model; as tests/test_loop.py's golden): on
a machine the file holds they must be equal bitwise; elsewhere within rtol 1e-4 of every recorded
machine's. `MAXTRAIN_UPDATE_GOLDENS=1` adds this machine's numbers (the checkpoint files are never
rewritten). Beside the numbers, the tree paths (with shapes and dtypes) of the params and opt_state
items, read from Orbax's metadata on disk, must equal the recorded ones, both in the fixture and in the
checkpoint the resumed run writes: a renamed key fails here even where a restore would cope.
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import ROOT, TINY, machine

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "checkpoints")
CASES = ("plain", "fp8_delayed", "pipeline_1f1b", "deepseek_bias", "local_tier")
METRICS = ("loss", "grad_norm")  # and a case's own, named in its expected.json ("metrics")


def expected_path(case: str) -> str:
    return os.path.join(FIXTURES, case, "expected.json")


def read_expected(case: str) -> dict:
    with open(expected_path(case)) as f:
        return json.load(f)


def _path_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def on_disk_keys(ck_dir: str, step: int) -> dict[str, list[str]]:
    """`path dtype shape` of every array of the step's params and opt_state items, from Orbax's
    metadata on disk (not through maxtrain, whose checkpoint code the refactor moves)."""
    import orbax.checkpoint as ocp
    from etils import epath

    out = {}
    for item in ("params", "opt_state"):
        path = epath.Path(os.path.abspath(os.path.join(ck_dir, str(step), item)))
        meta = ocp.StandardCheckpointHandler().metadata(path)
        leaves = jax.tree_util.tree_flatten_with_path(getattr(meta, "tree", meta))[0]
        out[item] = sorted(f"{'/'.join(_path_name(e) for e in p)} {np.dtype(m.dtype).name} {list(m.shape)}"
                           for p, m in leaves)
    return out


def local_keys(local_dir: str, step: int) -> list[str]:
    """The array names of the local tier's step (process 0's own copy), as its index.json holds them."""
    (key,) = [d for d in os.listdir(local_dir) if not d.startswith(".")]
    with open(os.path.join(local_dir, key, "p0", f"step_{step}", "src_p0", "index.json")) as f:
        return sorted(json.load(f)["arrays"])


def _lay_out(case: str, dest) -> list[str]:
    """Copies the case's fixture under `dest` and returns the path overrides that resume from it."""
    from maxtrain.checkpoint.local import run_key

    src = os.path.join(FIXTURES, case)
    ck = os.path.join(dest, "ck")
    shutil.copytree(os.path.join(src, "ck"), ck)
    paths = [f"run_dir={os.path.join(dest, 'run')}", f"checkpoint.dir={ck}"]
    if os.path.isdir(os.path.join(src, "local")):
        local = os.path.join(dest, "local")
        shutil.copytree(os.path.join(src, "local", "p0"), os.path.join(local, run_key(ck), "p0"))
        paths.append(f"checkpoint.local.dir={local}")
    return paths


def resume(case: str, dest, overrides: list[str]):
    """(the resumed run's TrainResult, the copied checkpoint.dir) of the case's fixture under `dest`."""
    from maxtrain import load_config, train

    paths = _lay_out(case, dest)
    return train(load_config(TINY, overrides + paths)), os.path.join(dest, "ck")


def numbers(result, metrics=METRICS) -> dict:
    return {"steps": [r["step"] for r in result.history], **{k: [r[k] for r in result.history] for k in metrics}}


@pytest.mark.default_codegen
# DeepSeek (MLA, MoE, MTP) compiles in 10-30 s on 2 shared cores: the quick subset leaves it out
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "deepseek_bias" else c
                                  for c in CASES])
def test_a_frozen_checkpoint_resumes_as_it_was_written(case, tmp_path):
    want = read_expected(case)
    assert on_disk_keys(os.path.join(FIXTURES, case, "ck"), want["persistent_step"]) == want["keys"]
    result, ck = resume(case, tmp_path, want["overrides"])
    assert result.start_step == want["saved_step"], f"resumed at step {result.start_step}, not from the fixture"
    metrics = want.get("metrics", METRICS)
    got = numbers(result, metrics)
    goldens = want["by_machine"]
    if os.environ.get("MAXTRAIN_UPDATE_GOLDENS") == "1":
        goldens[machine()] = got
        with open(expected_path(case), "w") as f:
            json.dump(want, f, indent=1, sort_keys=True)
    # the resumed run's own checkpoint (its final save) keeps the fixture's tree paths, shapes and dtypes
    assert on_disk_keys(ck, got["steps"][-1]) == want["keys"]
    if "local_keys" in want:
        assert local_keys(os.path.join(tmp_path, "local"), got["steps"][-1]) == want["local_keys"]
    for golden in goldens.values():
        assert got["steps"] == golden["steps"]
        for k in metrics:
            np.testing.assert_allclose(got[k], golden[k], rtol=1e-4, err_msg=k)
    if machine() in goldens:
        assert got == goldens[machine()]  # bitwise
