"""Plants small bugs one at a time in a scratch copy and runs the tests that should catch each.

    python tests/mutate.py                 # every mutant; prints caught/missed and the score
    python tests/mutate.py --only rope,ring  # mutants whose name contains "rope" or "ring"
    python tests/mutate.py --list
    python tests/mutate.py --file my_mutants.py  # also the MUTANTS list of that file (planting by hand)

The mutants are the list below (the bugs the suite was first written against) and one file per area
in tests/mutants/ (issue 39's classes: FP8 recipe internals, HF mappings and equal-shaped weights,
DeepSeek internals, documented special values, sampling and the losses, ownership and placement,
pipeline bookkeeping), each a `MUTANTS` list of `M(name, area, path, old, new, tests)`.

The scratch copy lays the package out as installed (`maxtrain/` with `kernels/` inside as
`maxtrain.kernels`) on PYTHONPATH, so the mutant, not the editable install, is what the tests
import; an unmutated baseline run of each mutant's tests (once per selection) must pass first. Not collected by pytest.
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
      ("tests/test_loss.py", "-k", "numpy_oracle_with_mask")),  # the recipe tests train with onepass (auto on CPU)
    M("fused_ce_no_max", "loss", "kernels/cross_entropy.py",
      "        m_new = jnp.maximum(m, jnp.max(logits, axis=1))", "        m_new = jnp.zeros_like(m)",
      ("tests/test_loss.py", "-k", "large_logits")),
    M("pallas_ce_no_max", "kernels", "kernels/cross_entropy.py",
      "        m_new = jnp.maximum(m, jnp.max(x, axis=1))", "        m_new = jnp.zeros_like(m)",
      ("tests/test_kernels.py", "-k", "cross_entropy_kernels")),
    # optimizer
    M("clip_elementwise", "optimizer", "maxtrain/optim.py", "optax.clip_by_global_norm(o.clip_norm)", "optax.clip(o.clip_norm)",
      ("tests/test_recipe.py", "-k", "cosine")),
    M("schedule_shifted_in_optimizer", "optimizer", "maxtrain/optim.py", "return optax.adamw(schedule, b1=o.b1",
      "return optax.adamw(lambda c: schedule(c + 1), b1=o.b1", ("tests/test_recipe.py", "-k", "linear")),
    M("decay_on_norms", "optimizer", "maxtrain/optim.py", 'lambda axes: "norm" not in axes', "lambda axes: True",
      ("tests/test_recipe.py", "-k", "cosine")),
    M("adam_betas_swapped", "optimizer", "maxtrain/optim.py", "b1=o.b1, b2=o.b2", "b1=o.b2, b2=o.b1",
      ("tests/test_recipe.py", "-k", "constant")),
    M("no_warmup_shift", "optimizer", "maxtrain/step.py", "return lambda count: schedule(count + 1)",
      "return lambda count: schedule(count)", ("tests/test_recipe.py", "-k", "linear")),
    M("grad_scale_per_row", "loss", "maxtrain/step.py", "n = jnp.maximum(stats[\"tokens\"], 1.0)",
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
    M("schedule_backward_of_another_microbatch", "parallelism", "maxtrain/parallel/pipeline.py",
      "jax.tree.map(lambda a: _at(a, m), batch_M), kind == sch.FORWARD_LOSS)",
      "jax.tree.map(lambda a: _at(a, (m + 1) % L.table.microbatches), batch_M), kind == sch.FORWARD_LOSS)",
      ("tests/test_schedules.py", "-k", "executed_schedule")),
    M("checksums_not_compared", "checkpoint", "maxtrain/checkpoint/manager.py",
      "bad = [k for k in actual if expected.get(k) != actual[k]]", "bad = []",
      ("tests/test_checkpoint.py", "-k", "flip or corrupt or truncat")),
    # MoE
    M("moe_token_major_priority", "parallelism", "maxtrain/layers/moe.py", "e_A = e_TK.T.reshape(-1)\n    t_A = jnp.tile(jnp.arange(T), K)",
      "e_A = e_TK.reshape(-1)\n    t_A = jnp.repeat(jnp.arange(T), K)", ("tests/test_moe.py", "-k", "gshard")),
    M("moe_top1_renormalised", "parallelism", "maxtrain/layers/moe.py", "if moe.norm_topk if moe.norm_topk is not None else K > 1:",
      "if moe.norm_topk if moe.norm_topk is not None else K > 0:",
      ("tests/test_moe.py", "-k", "numpy_routing")),
    M("moe_sigmoid_as_softmax", "parallelism", "maxtrain/layers/moe.py",
      'scores = jax.nn.softmax(logits_TE, axis=-1) if moe.router == "softmax" else jax.nn.sigmoid(logits_TE)',
      "scores = jax.nn.softmax(logits_TE, axis=-1)", ("tests/test_moe.py", "-k", "numpy_routing")),
    # model (more)
    M("gqa_heads_interleaved", "model", "maxtrain/layers/attention.py",
      "q = q_BLHK.reshape(B, L, G, H // G, K)", "q = q_BLHK.reshape(B, L, H // G, G, K).swapaxes(2, 3)",
      ("tests/test_hf.py", "-k", "matches_transformers")),
    # optimizer (more)
    M("cosine_floor_dropped", "optimizer", "maxtrain/optim.py", "optax.cosine_decay_schedule(o.lr, n, alpha=o.min_lr_ratio)",
      "optax.cosine_decay_schedule(o.lr, n, alpha=0.0)", ("tests/test_recipe.py", "-k", "cosine")),
    M("grad_accum_last_microbatch_only", "optimizer", "maxtrain/step.py",
      "return (jax.tree.map(jnp.add, acc_grads, grads),",
      "return (jax.tree.map(lambda c, x: x, acc_grads, grads),", ("tests/test_train.py", "-k", "grad_accumulation")),
    # data (more)
    M("epochs_not_shuffled", "data", "maxtrain/data/packing.py",
      "grain.MapDataset.range(max(self.n_rows, 1)).shuffle(seed=stream_seed)",
      "grain.MapDataset.range(max(self.n_rows, 1))", ("tests/test_data.py", "tests/test_prepare.py")),
    # checkpoint (more)
    M("resume_one_step_late", "checkpoint", "maxtrain/run/resume.py", "step = jax.device_put(jnp.asarray(r.step, jnp.int32)",
      "step = jax.device_put(jnp.asarray(r.step + 1, jnp.int32)", ("tests/test_checkpoint.py", "-k", "bitwise")),
    M("retention_keeps_oldest", "checkpoint", "maxtrain/checkpoint/manager.py",
      "keep = set(complete[-self.cfg.keep:]) | self._protected", "keep = set(complete[:self.cfg.keep]) | self._protected",
      ("tests/test_checkpoint.py", "-k", "retention")),
    M("fallback_tries_oldest_first", "checkpoint", "maxtrain/checkpoint/manager.py",
      "for step in reversed(steps if steps is not None else self.steps()):",
      "for step in (steps if steps is not None else self.steps()):", ("tests/test_checkpoint.py", "-k", "falls_back")),
    M("meta_digest_unchecked", "checkpoint", "maxtrain/checkpoint/manager.py",
      "if want is not None and meta_digest(meta) != want:", "if False and meta_digest(meta) != want:",
      ("tests/test_checkpoint.py", "-k", "edited_meta")),
    M("lock_takes_over_a_live_owner", "checkpoint", "maxtrain/checkpoint/lock.py",
      "        if locked is False:  # its flock is held", "        if locked is None:  # its flock is held",
      ("tests/test_checkpoint.py", "-k", "second_run")),
    # reliability
    M("guard_not_read_before_saves", "reliability", "maxtrain/run/checkpoints.py",
      "if saves_after(cfg, info) and reliability.guards_on(cfg.reliability):",
      "if False and reliability.guards_on(cfg.reliability):",
      ("tests/test_reliability.py", "-k", "keeps_no_checkpoint")),
    M("skip_streak_never_resets", "reliability", "maxtrain/reliability/guards.py",
      '"streak": jnp.where(event, guard["streak"] + 1.0, 0.0)', '"streak": guard["streak"] + event.astype(jnp.float32)',
      ("tests/test_reliability.py", "-k", "consecutive")),
    M("spike_sign_flipped", "reliability", "maxtrain/reliability/guards.py", "(x - mean > cfg.spike_sigma", "(mean - x > cfg.spike_sigma",
      ("tests/test_reliability.py", "-k", "spike")),
    # parallelism and sharding (more)
    M("ring_sends_the_wrong_way", "parallelism", "maxtrain/parallel/ring_attention.py",
      "             jnp.zeros((B, G, R, Lq), jnp.float32))\n    perm = [(j, (j + 1) % n) for j in range(n)]",
      "             jnp.zeros((B, G, R, Lq), jnp.float32))\n    perm = [(j, (j - 1) % n) for j in range(n)]",
      ("tests/test_parallel.py", "-k", "ring_matches_xla")),
    M("block_length_not_sequence_sharded", "sharding", "maxtrain/config.py",
      '"block_length": "sequence",  # inside', '"block_length": None,  # inside', ("tests/test_inspect.py", "-k", "golden")),
    M("kv_constrained_along_length", "sharding", "maxtrain/models/llama/model.py",
      'v = constrain(v, ("batch", kv_len, "kv_heads", "head_dim"), rules)',
      'v = constrain(v, ("batch", "block_length", "kv_heads", "head_dim"), rules)', ("tests/test_inspect.py", "-k", "golden")),
    M("mlp_activations_replicated", "sharding", "maxtrain/config.py", '"mlp": "tensor",\n        "vocab": "tensor",',
      '"mlp": None,\n        "vocab": "tensor",', ("tests/test_inspect.py", "-k", "golden")),
    # kernels (more)
    M("flash_dq_unscaled", "kernels", "kernels/flash.py", "dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)",
      "dq_ref[...] = dq.astype(dq_ref.dtype)", ("tests/test_kernels.py", "-k", "test_flash_attention_matches_reference")),
    M("flash_rescale_inverted", "kernels", "kernels/flash.py", "alpha = jnp.exp2(m - m_new)", "alpha = jnp.exp2(m_new - m)",
      ("tests/test_kernels.py", "-k", "test_flash_attention_matches_reference")),
    M("flash_diagonal_block_unmasked", "kernels", "kernels/flash.py", "hi_full = lax.div(r0 + 1, bk)",
      "hi_full = lax.div(r0 + bk, bk)", ("tests/test_kernels.py", "-k", "test_flash_attention_matches_reference or block_skipping")),
    M("flash_window_off_by_one", "kernels", "kernels/flash.py", "mask = both(mask, rows - cols < st.window)",
      "mask = both(mask, rows - cols <= st.window)", ("tests/test_kernels.py", "-k", "test_flash_attention_matches_reference")),
    M("rms_norm_kernel_eps", "kernels", "kernels/rms_norm.py", "rstd = jax.lax.rsqrt(jnp.mean(h * h, axis=1) + st.eps)",
      "rstd = jax.lax.rsqrt(jnp.mean(h * h, axis=1) + 1e-2)", ("tests/test_kernels.py", "-k", "rms_norm_with_residual")),
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


def _load(path: str) -> list[Mutant]:
    """The MUTANTS of another file: Mutant objects or (name, area, path, old, new, tests) tuples."""
    space: dict = {"Mutant": Mutant, "M": Mutant}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), space)
    return [m if isinstance(m, Mutant) else Mutant(*m) for m in space["MUTANTS"]]


def all_mutants() -> list[Mutant]:
    """The list above, then every tests/mutants/*.py file's, in file order."""
    folder = os.path.join(ROOT, "tests", "mutants")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".py")) if os.path.isdir(folder) else []
    return MUTANTS + [m for f in files for m in _load(os.path.join(folder, f))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated parts of mutant names")
    p.add_argument("--list", action="store_true")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--file", default=None, help="a Python file whose MUTANTS list (of Mutant or tuples) runs too")
    a = p.parse_args(argv)
    wanted = None if a.only is None else a.only.split(",")
    pool = all_mutants() + ([] if a.file is None else _load(a.file))
    chosen = [m for m in pool if wanted is None or any(w in m.name for w in wanted)]
    if a.list:
        for m in chosen:
            print(f"{m.name:32s} {m.area:12s} {m.path}  <- {' '.join(m.tests)}")
        return 0
    caught, rows, baselines = 0, [], {}  # an unmutated run per test selection: the tree is the same for all
    with tempfile.TemporaryDirectory(prefix="maxtrain-mutate-") as scratch:
        _scratch_copy(scratch)
        check = subprocess.run([sys.executable, "-c", "import maxtrain.kernels as k; print(k.__file__)"],
                               env={**os.environ, "PYTHONPATH": os.path.join(scratch, "pkg")}, capture_output=True,
                               text=True, cwd=scratch).stdout.strip()
        assert check.startswith(scratch), f"the scratch copy is not what imports: {check}"
        for m in chosen:
            path = _target(scratch, m.path)
            with open(path) as f:
                original = f.read()
            if original.count(m.old) != 1:
                rows.append((m, "STALE (snippet not found once)", 0.0))
                continue
            t0 = time.time()
            if m.tests not in baselines:
                baselines[m.tests] = _pytest(scratch, m.tests, a.timeout)
            if baselines[m.tests] != 0:
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
