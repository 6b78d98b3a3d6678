"""Plants small bugs one at a time in a scratch copy and runs the tests that should catch each.

    python tests/mutate.py                 # every mutant; prints caught/missed and the score
    python tests/mutate.py --only rope     # mutants whose name contains "rope"
    python tests/mutate.py --list

The scratch copy lays the package out as installed (`maxtrain/` with `kernels/` inside as
`maxtrain.kernels`) on PYTHONPATH, so the mutant, not the editable install, is what the tests
import; an unmutated baseline run of each mutant's tests must pass first. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    path: str  # relative to the checkout
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments (node ids or files with -k)


M = Mutant
MUTANTS = [
    # model
    M("rope_sign", "model", "maxtrain/layers/rope.py", "[x1 * cos - x2 * sin, x2 * cos + x1 * sin]",
      "[x1 * cos + x2 * sin, x2 * cos - x1 * sin]", ("tests/test_model.py::test_rope_rotates_pairs_by_hand_computed_angles",)),
    M("rmsnorm_no_scale", "model", "maxtrain/layers/norms.py", "return (y * scale).astype", "return (y + 0 * scale).astype",
      ("tests/test_hf.py", "-k", "matches_transformers")),
    M("rmsnorm_eps_outside", "model", "maxtrain/layers/norms.py",
      "jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)", "jnp.mean(jnp.square(x), axis=-1, keepdims=True)) + eps",
      ("tests/test_hf.py", "-k", "matches_transformers")),
    M("causal_off_by_one", "model", "maxtrain/layers/attention.py", "mask = (j <= i) if causal", "mask = (j < i + 2) if causal",
      ("tests/test_model.py", "-k", "causal")),
    M("segments_ignored", "model", "maxtrain/layers/attention.py",
      "same = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]",
      "same = (q_segment_ids[:, :, None] >= 0 * kv_segment_ids[:, None, :])[:, None]", ("tests/test_model.py", "-k", "segment")),
    M("attention_scale", "model", "maxtrain/layers/attention.py", "s_BGRLS * (K ** -0.5)", "s_BGRLS * (K ** -0.25)",
      ("tests/test_hf.py", "-k", "matches_transformers")),
    M("swiglu_gate_up_swapped", "model", "maxtrain/layers/mlp.py", "jax.nn.silu(gate) * up", "gate * jax.nn.silu(up)",
      ("tests/test_hf.py", "-k", "matches_transformers")),
    # loss
    M("loss_ignores_mask", "loss", "maxtrain/loss.py", "nll_sum = jnp.sum(nll_BL * loss_mask_BL)", "nll_sum = jnp.sum(nll_BL)",
      ("tests/test_recipe.py", "-k", "cosine")),
    M("fused_ce_no_max", "loss", "kernels/cross_entropy.py",
      "        m_new = jnp.maximum(m, jnp.max(logits, axis=1))", "        m_new = jnp.zeros_like(m)",
      ("tests/test_loss.py", "-k", "large_logits")),
    M("pallas_ce_no_max", "kernels", "kernels/cross_entropy.py",
      "        m_new = jnp.maximum(m, jnp.max(x, axis=1))", "        m_new = jnp.zeros_like(m)",
      ("tests/test_kernels.py", "-k", "cross_entropy_kernels")),
    # optimizer
    M("clip_elementwise", "optimizer", "maxtrain/optim.py", "optax.clip_by_global_norm(o.clip_norm)", "optax.clip(o.clip_norm)",
      ("tests/test_recipe.py", "-k", "cosine")),
    M("schedule_shifted_in_optimizer", "optimizer", "maxtrain/optim.py", "parts.append(optax.adamw(schedule,",
      "parts.append(optax.adamw(lambda c: schedule(c + 1),", ("tests/test_recipe.py", "-k", "linear")),
    M("decay_on_norms", "optimizer", "maxtrain/optim.py", 'lambda axes: "norm" not in axes', "lambda axes: True",
      ("tests/test_recipe.py", "-k", "cosine")),
    M("adam_betas_swapped", "optimizer", "maxtrain/optim.py", "b1=o.b1, b2=o.b2", "b1=o.b2, b2=o.b1",
      ("tests/test_recipe.py", "-k", "constant")),
    M("no_warmup_shift", "optimizer", "maxtrain/train.py", "return lambda count: schedule(count + 1)",
      "return lambda count: schedule(count)", ("tests/test_recipe.py", "-k", "linear")),
    M("grad_scale_per_row", "loss", "maxtrain/train.py", "n = jnp.maximum(stats[\"tokens\"], 1.0)",
      "n = jnp.maximum(stats[\"tokens\"], 1.0) * 0 + batch[\"inputs\"].size", ("tests/test_recipe.py", "-k", "cosine")),
    # data
    M("positions_not_reset", "data", "maxtrain/data/packing.py", "positions = (idx - row_start).astype(np.int32)",
      "positions = (idx - offset).astype(np.int32)", ("tests/test_data.py", "tests/test_prepare.py", "-k", "pack or round_trip")),
    M("cross_document_targets", "data", "maxtrain/data/packing.py", '"loss_mask": (seg[:-1] == seg[1:]).astype(np.float32)',
      '"loss_mask": np.ones(len(seg) - 1, np.float32)', ("tests/test_data.py", "tests/test_prepare.py", "-k", "pack")),
    # parallelism and checkpoints
    M("pipeline_rows_of_another_microbatch", "parallelism", "maxtrain/parallel/pipeline.py",
      "y, stats = visit(inp, layers, r, jax.tree.map(lambda a: _at(a, m), rows_M))",
      "y, stats = visit(inp, layers, r, jax.tree.map(lambda a: _at(a, (m + 1) % M), rows_M))",
      ("tests/test_pipeline.py", "-k", "matches_one_device")),
    M("checksums_not_compared", "checkpoint", "maxtrain/checkpoint.py",
      "bad = [k for k in actual if expected.get(k) != actual[k]]", "bad = []",
      ("tests/test_checkpoint.py", "-k", "flip or corrupt or truncat")),
    # MoE
    M("moe_token_major_priority", "parallelism", "maxtrain/layers/moe.py", "e_A = e_TK.T.reshape(-1)\n    t_A = jnp.tile(jnp.arange(T), K)",
      "e_A = e_TK.reshape(-1)\n    t_A = jnp.repeat(jnp.arange(T), K)", ("tests/test_moe.py", "-k", "gshard")),
    M("moe_top1_renormalised", "parallelism", "maxtrain/layers/moe.py", "if K > 1:  # renormalised", "if K > 0:  # renormalised",
      ("tests/test_moe.py", "-k", "numpy_routing")),
    M("moe_sigmoid_as_softmax", "parallelism", "maxtrain/layers/moe.py",
      'scores = jax.nn.softmax(logits_TE, axis=-1) if moe.router == "softmax" else jax.nn.sigmoid(logits_TE)',
      "scores = jax.nn.softmax(logits_TE, axis=-1)", ("tests/test_moe.py", "-k", "numpy_routing")),
]


def _scratch_copy(dst: str) -> None:
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "runs", ".pytest_cache")
    for item in os.listdir(ROOT):
        src = os.path.join(ROOT, item)
        if item in (".git", "maxtrain", "kernels") or not (os.path.isdir(src) or os.path.isfile(src)):
            continue
        (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(dst, item), **(
            {"ignore": ignore} if os.path.isdir(src) else {}))
    shutil.copytree(os.path.join(ROOT, "maxtrain"), os.path.join(dst, "pkg", "maxtrain"), ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "kernels"), os.path.join(dst, "pkg", "maxtrain", "kernels"), ignore=ignore)
    os.makedirs(os.path.join(dst, "kernels"))  # tests only need the directory to exist beside tests/


def _target(scratch: str, rel: str) -> str:
    if rel.startswith("kernels/"):
        return os.path.join(scratch, "pkg", "maxtrain", rel)
    if rel.startswith("maxtrain/"):
        return os.path.join(scratch, "pkg", rel)
    return os.path.join(scratch, rel)


def _pytest(scratch: str, args: tuple[str, ...], timeout: float) -> int:
    env = {**os.environ, "PYTHONPATH": os.path.join(scratch, "pkg")}
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args],
                              cwd=scratch, env=env, capture_output=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return -1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None)
    p.add_argument("--list", action="store_true")
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)
    chosen = [m for m in MUTANTS if a.only is None or a.only in m.name]
    if a.list:
        for m in chosen:
            print(f"{m.name:32s} {m.area:12s} {m.path}  <- {' '.join(m.tests)}")
        return 0
    caught, rows = 0, []
    with tempfile.TemporaryDirectory(prefix="maxtrain-mutate-") as scratch:
        _scratch_copy(scratch)
        check = subprocess.run([sys.executable, "-c", "import maxtrain, sys; print(maxtrain.__file__)"],
                               env={**os.environ, "PYTHONPATH": os.path.join(scratch, "pkg")}, capture_output=True,
                               text=True).stdout.strip()
        assert check.startswith(scratch), f"the scratch copy is not what imports: {check}"
        for m in chosen:
            path = _target(scratch, m.path)
            with open(path) as f:
                original = f.read()
            if original.count(m.old) != 1:
                rows.append((m, "STALE (snippet not found once)", 0.0))
                continue
            t0 = time.time()
            if _pytest(scratch, m.tests, a.timeout) != 0:
                rows.append((m, "BASELINE FAILS", time.time() - t0))
                continue
            with open(path, "w") as f:
                f.write(original.replace(m.old, m.new))
            try:
                rc = _pytest(scratch, m.tests, a.timeout)
            finally:
                with open(path, "w") as f:
                    f.write(original)
            verdict = "caught" if rc != 0 else "MISSED"
            caught += rc != 0
            rows.append((m, verdict, time.time() - t0))
            print(f"{m.name:32s} {m.area:12s} {verdict:8s} {time.time() - t0:6.0f}s  {' '.join(m.tests)}", flush=True)
    scored = [r for r in rows if r[1] in ("caught", "MISSED")]
    for m, verdict, _ in rows:
        if verdict not in ("caught", "MISSED"):
            print(f"{m.name:32s} {m.area:12s} {verdict}")
    print(f"score: {caught}/{len(scored)} caught ({100 * caught / max(len(scored), 1):.0f}%)")
    return 0 if len(scored) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
