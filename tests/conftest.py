"""Test setup: 8 fake CPU devices and 16 XLA:CPU threads (set before jax is imported), strict numpy
rank promotion, and XLA:CPU flags that compile the suite's hundreds of tiny programs fast."""

import importlib.metadata
import os
import subprocess
import sys

# XLA_FLAGS as the user set them, before this file adds its own: a child pytest starts from them. Kept
# in the environment, because pytest-xdist's workers inherit the controller's already-extended flags.
USER_XLA_FLAGS = os.environ.setdefault("MAXTRAIN_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))

# XLA:CPU at LLVM -O0: the suite compiles hundreds of tiny programs and runs each a few times, so
# code generation dominates; MAXTRAIN_TEST_XLA_OPT=1 keeps XLA's default.
FAST_COMPILE = "" if os.environ.get("MAXTRAIN_TEST_XLA_OPT") == "1" else \
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# XLA:CPU's older element-wise emitters compile these programs in less than half the time of its
# MLIR fusion emitters (jaxlib 0.10: 1.6 s against 4.1 s for a small model's train step; backend
# compilation was 60% of the suite's time). Their transcendental functions round differently (a
# cosine's last bit), so tests whose numbers are recorded bitwise (the goldens, the frozen
# checkpoints: marked `default_codegen`) run in a child pytest on XLA's default emitters.
# The flag is jaxlib 0.10's (an unknown XLA flag aborts): other versions keep the default.
DEFAULT_CODEGEN = (os.environ.get("MAXTRAIN_TEST_DEFAULT_CODEGEN") == "1"
                   or os.environ.get("MAXTRAIN_TEST_XLA_OPT") == "1"
                   or not importlib.metadata.version("jaxlib").startswith("0.10."))
if not DEFAULT_CODEGEN:
    FAST_COMPILE += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (USER_XLA_FLAGS + " --xla_force_host_platform_device_count=8" + FAST_COMPILE).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU sizes its thread pool from NPROC (else the core count, 2 in CI). The Mosaic GPU
# interpreter (kernels/flash_hopper.py's tests) blocks one pool thread per simulated warpgroup.
if int(os.environ.get("NPROC") or 0) < 16:  # a CI that sets NPROC to its core count would deadlock it
    os.environ["NPROC"] = "16"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")

# A model small enough that 8 fake devices on 2 CPU cores compile and step it in seconds, on packed
# irregular rows (documents of random length, masked tokens, padding tails): per-row metadata matters.
SMALL = [
    "model.vocab_size=128", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
    "model.n_kv_heads=2", "model.d_ff=128", "train.batch_size=16", "train.seq_len=32",
    "train.dtype=float32", "train.log_every=1", "optim.warmup_steps=2", "optim.lr=1e-2",
    "data.kind=synthetic", "data.synthetic_doc_len=10",
]


@pytest.fixture
def small_overrides(tmp_path):
    return SMALL + [f"run_dir={tmp_path / 'run'}"]


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    """`run(overrides)`: `train` of TINY with `overrides` on one device, once per module and test worker
    for each list of overrides (the reference that several of a module's tests compare against: read,
    never changed), in a run_dir of its own."""
    runs = {}

    def run(overrides):
        from maxtrain import load_config, train

        key = tuple(overrides)
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("one_device") / "run"
            runs[key] = train(load_config(TINY, [*overrides, f"run_dir={run_dir}"]), devices=jax.devices()[:1])
        return runs[key]

    return run

# The child of `default_codegen` tests: one per process of this run (an xdist worker, or pytest
# itself without -n), started at its first such test and kept for the rest, so that the tests of
# every file share one start-up (python, jax, maxtrain, conftest: 4-5 s) and the child's jax caches.
# It runs one test per `pytest.main` and answers each with its exit code on a pipe of its own; its
# stdout and stderr go to a log file, and each test's report to a file of its own.
_CHILD = r"""
import contextlib, json, os, sys
import pytest

answers = os.fdopen(int(sys.argv[1]), "w")
for request in sys.stdin:
    nodeid, report = json.loads(request)
    with open(report, "w") as out, contextlib.redirect_stdout(out):
        code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=-ra", nodeid])
    answers.write(f"{int(code)}\n")
    answers.flush()
"""
_child = None  # (process, answers, log path)


def _default_codegen_child():
    global _child
    if _child is not None and _child[0].poll() is None:
        return _child
    _stop_default_codegen_child()
    import tempfile

    env = dict(os.environ, XLA_FLAGS=USER_XLA_FLAGS, MAXTRAIN_TEST_DEFAULT_CODEGEN="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    log = tempfile.NamedTemporaryFile(prefix="maxtrain-default-codegen-", suffix=".log", delete=False)
    read, write = os.pipe()
    process = subprocess.Popen([sys.executable, "-c", _CHILD, str(write)], cwd=ROOT, env=env, text=True,
                               stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write,))
    os.close(write)
    log.close()
    _child = (process, os.fdopen(read), log.name)
    return _child


def _stop_default_codegen_child(kill: bool = False):
    global _child
    if _child is None:
        return
    process, answers, log = _child
    _child = None
    try:
        if not kill:
            process.stdin.close()  # the child's loop ends
            process.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if process.poll() is None:
        process.kill()
        process.wait()
    answers.close()
    os.unlink(log)


def pytest_unconfigure(config):
    _stop_default_codegen_child()


def pytest_pyfunc_call(pyfuncitem):
    """A `default_codegen` test, in a process on the fast emitters, runs in a child pytest on XLA's
    default ones (its outcome is this test's)."""
    if DEFAULT_CODEGEN or pyfuncitem.get_closest_marker("default_codegen") is None:
        return None
    import json
    import tempfile

    process, answers, log = _default_codegen_child()
    logged = os.path.getsize(log)
    fd, report = tempfile.mkstemp(prefix="maxtrain-default-codegen-", suffix=".out")
    os.close(fd)
    try:
        try:
            process.stdin.write(json.dumps([pyfuncitem.nodeid, report]) + "\n")
            process.stdin.flush()
            answer = answers.readline()
        except BaseException:  # a timeout here, or the child gone: the next test starts a fresh child
            _stop_default_codegen_child(kill=True)
            raise
        with open(report) as f:
            lines = f.read().splitlines()
    finally:
        os.unlink(report)
    tail = "\n".join(lines[-60:])
    if not answer:
        with open(log, errors="replace") as f:
            f.seek(logged)
            stderr = f.read()
        _stop_default_codegen_child(kill=True)
        pytest.fail(f"the child pytest on XLA's default CPU emitters died (exit {process.returncode}):\n{tail}"
                    f"\n{stderr[-2000:]}", pytrace=False)
    if int(answer) != 0:
        with open(log, errors="replace") as f:
            f.seek(logged)
            stderr = f.read()
        pytest.fail(f"in a child pytest on XLA's default CPU emitters (exit {int(answer)}):\n{tail}"
                    f"\n{stderr[-2000:]}", pytrace=False)
    if not lines or " 1 passed" not in " " + lines[-1]:
        pytest.skip(f"in a child pytest on XLA's default CPU emitters: {lines[-1] if lines else '(no report)'}")
    return True


# The files of the longest tests first (pytest-xdist hands out tests in this order): under `-n 2` a
# one-minute test collected last would run alone at the end while the other worker idles.
FIRST = ("test_slurm.py", "test_launch.py", "test_local_checkpoint.py", "test_frozen_checkpoints.py",
         "test_targets.py")  # (pytest-xdist sends the rest in ever smaller chunks: collected last, the
# CUDA-target compiles, 10-30 s each, could leave one worker waiting on the other)


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


def machine() -> str:
    """Where bitwise equality is promised (the goldens and frozen checkpoints are keyed by it): the
    same jaxlib on the same kind of CPU with the same vector instructions (XLA:CPU compiles for the
    host's: two "AMD EPYC" generations, one with AVX-512, round differently)."""
    import platform

    return f"jaxlib {jax.lib.__version__}, {platform.machine()}, {_cpu_model()}, {_vector_isa()}"


def _vector_isa() -> str:
    """The widest vector instruction sets the CPU reports (x86: AVX-512 and its bf16, AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return "?"
    wide = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return "+".join(wide) or ("avx2" if "avx2" in flags else "no avx2")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


def tagged_tensors(shapes):
    """name -> float32 tensor for each (name, shape), tensor n holding n * 2**14 + 0, 1, 2, ... (exact
    in float32): every element of every tensor a value no other element holds (conversion tests)."""
    import numpy as np

    out = {name: (n * 2**14 + np.arange(np.prod(s))).reshape(s).astype(np.float32)
           for n, (name, s) in enumerate(shapes)}
    assert all(np.prod(s) <= 2**14 for s in map(np.shape, out.values())) and len(out) * 2**14 < 2**24
    return out


def assert_one_slice_each(tensors: dict, params, want, leaf_of) -> None:
    """`params` (converted from `tagged_tensors`) has the tree and shapes of `want` (the model's own
    init), each tensor lies whole in the slice `leaf_of(name) -> (path, index)` names, and every
    element came from exactly one tensor element: nothing dropped, duplicated or swapped."""
    import functools
    import operator

    import numpy as np

    assert jax.tree.structure(params) == jax.tree.structure(want)
    assert jax.tree.leaves(jax.tree.map(np.shape, params)) == jax.tree.leaves(jax.tree.map(np.shape, want))
    for name, t in tensors.items():
        path, index = leaf_of(name)
        got = functools.reduce(operator.getitem, path, params)[index]
        np.testing.assert_array_equal(np.sort(got, axis=None), np.sort(t, axis=None), err_msg=name)
    every = np.sort(np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)]))
    np.testing.assert_array_equal(every, np.sort(np.concatenate([t.ravel() for t in tensors.values()])))


def randomized_hf_model(model):
    """`model` (transformers) with every parameter and correction-bias buffer re-drawn with distinct
    random values from torch's generator: norm scales 1 + 0.1 N(0, 1), everything else 0.1 N(0, 1).

    transformers initialises every RMSNorm to ones (and biases to zeros), so without this two norms
    of one shape (input / post-attention, q_norm / k_norm, q_a_layernorm / kv_a_layernorm) are
    interchangeable and a converter that swaps them still matches; every weight drawn here, not left
    to transformers' init, keeps that true whatever its init does in a later version."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    values = [p.detach().flatten()[:4] for p in model.parameters()]
    assert len({tuple(v.tolist()) for v in values}) == len(values), "two parameters drew the same values"
    return model
