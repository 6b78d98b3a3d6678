"""Documented special values of config keys (docs/config.md: `0` disables or means X, `null` means
X): each one's behaviour against what the docs say it means, through the function that consumes
the key. The expected values are derived here from the documented rule (written out in each
test), not read back from the code; a special value that fell through as an ordinary number (0 as
a period, a size or a step, null as a value) fails these."""

import io
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY
from maxtrain import load_config, models
from maxtrain.config import DrillsConfig, ProfileConfig, ReliabilityConfig


# ---------------------------------------------------------------- model: null sizes


def _param_shapes(cfg) -> dict:
    shapes = jax.eval_shape(lambda k: models.get(cfg.model.name).init(cfg, k), jax.random.key(0))
    return {jax.tree_util.keystr(p): s.shape for p, s in jax.tree_util.tree_leaves_with_path(shapes)}


SMALL_LLAMA = ["model.vocab_size=64", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.d_ff=24"]


@pytest.mark.parametrize("d_ff, width", [("null", 24), ("40", 40)])
def test_moe_d_ff_null_is_the_dense_width(d_ff, width):
    cfg = load_config(None, SMALL_LLAMA + [f"model.moe={{num_experts: 4, top_k: 2, d_ff: {d_ff}}}"])
    shapes = _param_shapes(cfg)
    ups = {k: s for k, s in shapes.items() if "w_up" in k}
    assert ups and all(s[-2:] == (16, width) for s in ups.values()), ups  # [.., experts, embed, expert width]


DS = ["model.name=deepseek", "model.vocab_size=64", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
      "model.d_ff=24"]
MLA = "kv_lora_rank: 6, qk_nope_head_dim: 4, qk_rope_head_dim: 2, v_head_dim: 4"


@pytest.mark.parametrize("q_rank, rate", [("null", 0.0), ("5", 0.01)])
def test_deepseek_null_query_rank_and_zero_bias_rate(q_rank, rate):
    """q_lora_rank null: one full-rank query projection [embed, heads, qk] and no latent; rank r: a
    down-projection to r and an up-projection from it. bias_update_rate 0: no balancing bias at
    all; > 0: one per layer and expert, which the optimizer leaves alone."""
    cfg = load_config(None, DS + [f"model.mla={{q_lora_rank: {q_rank}, {MLA}}}",
                                  f"model.moe={{num_experts: 4, top_k: 2, d_ff: 8, bias_update_rate: {rate}}}"])
    shapes = _param_shapes(cfg)
    wq = {k.rsplit("'", 2)[-2]: s for k, s in shapes.items() if "['layers']['wq" in k}
    if q_rank == "null":
        assert wq == {"wq": (2, 16, 2, 6)}  # layers, embed, heads, nope + rope
    else:
        assert {k: s[-1] if k != "wq_b" else s[1:] for k, s in wq.items()} == {"wq_a": 5, "wq_b": (5, 2, 6)}, wq
    bias = {k: s for k, s in shapes.items() if k.endswith("['bias']")}
    assert bias == ({} if rate == 0 else {"['layers']['moe']['bias']": (2, 4)})
    if rate:
        learned = models.get("deepseek").learned(cfg)
        assert learned["layers"]["moe"]["bias"] is False and learned["layers"]["moe"]["router"] is True


# ---------------------------------------------------------------- train


def _scan_lengths(jaxpr) -> list[int]:
    """The lengths of every scan in `jaxpr`, nested ones (inside custom_vjp, pjit) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn.params["length"])
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                found += _scan_lengths(inner)
    return found


@pytest.mark.parametrize("tokens, n_tokens, chunks", [
    (0, 2048, 4),  # a quarter of a device's tokens: 512 per chunk
    (0, 1000, 4),  # ceil(1000 / 4) = 250 per chunk
    (0, 300, 3),  # a quarter (75) is below the floor: 128 per chunk, the last one padded
    (0, 96, 1),  # fewer tokens than the floor: one chunk of all of them
    (100, 300, 3),  # an explicit count
    (64, 2048, 32),
])
def test_onepass_cross_entropy_tokens_zero_is_a_quarter_of_the_tokens_at_least_128(tokens, n_tokens, chunks):
    """`train.cross_entropy_tokens`: the float32 logits exist this many tokens at a time (one scan
    iteration each); 0: max(128, ceil(N / 4)) of a device's N tokens, at most N."""
    from maxtrain.loss import onepass_loss

    D, V = 8, 16
    h = jnp.zeros((1, n_tokens, D), jnp.float32)
    w = jnp.zeros((D, V), jnp.float32)
    t = jnp.zeros((1, n_tokens), jnp.int32)
    m = jnp.ones((1, n_tokens), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda h, w: onepass_loss(h, w, t, m, tokens=tokens, z_loss=0.0, act_rules={},
                                                     param_rules={})[0])(h, w)
    assert set(_scan_lengths(jaxpr.jaxpr)) == {chunks}


def test_peak_tflops_null_is_the_device_table():
    from maxtrain.metrics import peak_tflops, throughput

    assert peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.0  # null: detected from the device name
    assert peak_tflops("NVIDIA H100 80GB HBM3", 500.0) == 500.0  # a number wins
    assert peak_tflops("cpu", None) is None  # unknown device: no MFU
    assert throughput(2.0, 100, 4e12, 2, None)["mfu"] is None
    assert throughput(2.0, 100, 4e12, 2, 500.0)["mfu"] == pytest.approx(1.0 / 500.0)


def _info(step, **kw):
    from maxtrain.run import StepInfo

    return StepInfo(step, None, {}, kw.get("stopping", False), kw.get("final", False))


def test_zero_periods_disable_evaluation_samples_and_periodic_saves():
    """eval_every 0: no evaluation, not even at the last step; sample_every 0: no samples;
    checkpoint.every 0: saves only at the end and on preemption; checkpoint.dir null: none at all."""
    from maxtrain.run.context import is_checkpoint_step, is_eval_step, is_log_step, is_sample_step, saves_after

    cfg = load_config(TINY, ["train.steps=12", "train.log_every=100", "train.eval_every=0", "train.sample_every=0",
                             "checkpoint.dir=/x", "checkpoint.every=0"])
    steps = range(1, 13)
    assert [s for s in steps if is_eval_step(cfg, s) or is_sample_step(cfg, s) or is_checkpoint_step(cfg, s)] == []
    assert [s for s in steps if saves_after(cfg, _info(s, final=s == 12))] == [12]
    assert saves_after(cfg, _info(5, stopping=True))
    assert [s for s in steps if is_log_step(cfg, _info(s, final=s == 12), first=0)] == [1, 12]
    on = load_config(TINY, ["train.steps=12", "train.eval_every=5", "train.sample_every=4", "checkpoint.dir=/x",
                            "checkpoint.every=4"])
    assert [s for s in steps if is_eval_step(on, s)] == [5, 10, 12]  # and at the last step
    assert [s for s in steps if is_sample_step(on, s)] == [4, 8, 12]
    assert [s for s in steps if is_checkpoint_step(on, s)] == [4, 8, 12]
    off = load_config(TINY, ["train.steps=12", "checkpoint.every=4"])  # checkpoint.dir null
    assert not any(is_checkpoint_step(off, s) or saves_after(off, _info(s, final=s == 12, stopping=True))
                   for s in steps)


def test_empty_sample_prompt_starts_from_the_end_of_text_token(tmp_path):
    from maxtrain.generate import Sampler

    (tmp_path / "a.txt").write_text("some text\n" * 50)
    common = [*SMALL_LLAMA, "model.vocab_size=260", "data.kind=text", f"data.path={tmp_path / 'a.txt'}"]
    empty = Sampler(load_config(None, common + ["train.sample_every=2"]))
    assert empty.tok is not None and empty.tok.eos_id != 0
    assert np.asarray(empty.prompt).tolist() == [[empty.tok.eos_id]]
    text = Sampler(load_config(None, common + ["train.sample_every=2", "train.sample_prompt=ab"]))
    assert np.asarray(text.prompt).tolist() == [list(b"ab")]


# ---------------------------------------------------------------- data


def test_synthetic_doc_len_zero_is_one_document_per_row():
    from maxtrain.data.synthetic import SyntheticSource

    cfg = load_config(None, ["train.batch_size=4", "train.seq_len=32", "model.vocab_size=64"])
    rows = SyntheticSource(cfg).batch(0)
    assert (rows["segment_ids"] == 1).all() and (rows["loss_mask"] == 1).all()
    assert (rows["positions"] == np.arange(32)).all()
    V = 64  # each row one progression (a + i b) mod V: constant steps, continued by the targets
    d = (rows["inputs"][:, 1:] - rows["inputs"][:, :-1]) % V
    assert (d == d[:, :1]).all() and (rows["targets"][:, :-1] == rows["inputs"][:, 1:]).all()
    packed = SyntheticSource(load_config(None, ["train.batch_size=4", "train.seq_len=32", "model.vocab_size=64",
                                                "data.synthetic_doc_len=4"])).batch(0)
    assert packed["segment_ids"].max() > 1 and (packed["positions"] == 0).sum() > 4


# ---------------------------------------------------------------- reliability


def _guard(streak: int) -> dict:
    return {"events": float(streak), "last_kind": 1.0, "last_step": 7.0, "last_value": float("nan"),
            "streak": float(streak), "worst_streak": float(streak)}


def test_max_consecutive_skips_zero_never_halts():
    from maxtrain import reliability

    assert reliability.report_events(_guard(50), 0, ReliabilityConfig(max_consecutive_skips=0)) == (50, None)
    assert reliability.report_events(_guard(2), 0, ReliabilityConfig(max_consecutive_skips=3)) == (2, None)
    with pytest.raises(reliability.Halted, match="3 updates in a row"):
        reliability.report_events(_guard(3), 0, ReliabilityConfig(max_consecutive_skips=3))


def _exits(seconds: float, phase_limit=None, **limits) -> list:
    """The exit codes a watchdog with these `limits` calls within `seconds` of no beats (inside a
    restore phase with `phase_limit` when given)."""
    from maxtrain import reliability

    exited = []
    dog = reliability.Watchdog(ReliabilityConfig(**limits), exit_fn=exited.append, stream=io.StringIO()).start()
    if phase_limit is None:
        time.sleep(seconds)
    else:
        with dog.phase("checkpoint restore", phase_limit):
            time.sleep(seconds)
    dog.stop()
    return exited


def test_zero_timeouts_turn_the_watchdog_off():
    """hang_timeout_s 0: no limit on steps (not first_step_timeout_s either); restore_timeout_s 0:
    a restore has no limit, whatever the step limits are. Each against a short limit that fires."""
    from maxtrain.reliability import HANG_EXIT_CODE

    assert _exits(0.4, hang_timeout_s=0, first_step_timeout_s=0.1, restore_timeout_s=0.2) == []
    assert _exits(0.4, phase_limit=0, hang_timeout_s=0.1, first_step_timeout_s=0.1, restore_timeout_s=0) == []
    assert _exits(0.4, phase_limit=0.1, hang_timeout_s=0, first_step_timeout_s=5,
                  restore_timeout_s=0.1) == [HANG_EXIT_CODE]  # the limits do fire


def test_compilation_cache_null_is_off():
    from maxtrain import reliability

    before = jax.config.jax_compilation_cache_dir
    assert reliability.enable_compilation_cache(None) is None
    assert jax.config.jax_compilation_cache_dir == before


def test_straggler_every_zero_never_compares(monkeypatch):
    from jax.experimental import multihost_utils

    from maxtrain import reliability

    calls = []
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: calls.append(x) or np.asarray(x)[None])
    watch = reliability.StragglerWatch(ReliabilityConfig(straggler_every=0))
    for step in range(1, 7):
        watch.add(0.1, 0.0)
        assert watch.check(step) is None
    assert calls == []
    watch = reliability.StragglerWatch(ReliabilityConfig(straggler_every=3))
    got = []
    for step in range(1, 7):
        watch.add(0.1, 0.0)
        got.append(watch.check(step))
    assert [g is not None for g in got] == [False, False, True, False, False, True]


def test_replay_and_fingerprint_every_zero_are_off(monkeypatch):
    """replay_every 0: no step is replayed; fingerprint_every 0: no replica check, not even before
    the saves (with a period, before every save as well)."""
    from maxtrain import reliability
    from maxtrain.run import checks

    replayed, checked = [], []
    monkeypatch.setattr(checks.Replay, "check", lambda self, setup, state, batch, step: replayed.append(step))
    monkeypatch.setattr(reliability, "check_replicas", lambda fp, params, mesh, axes, step: checked.append(step))
    monkeypatch.setattr(reliability, "replica_axes", lambda shardings, mesh: ())

    def run(*overrides):
        replayed.clear(), checked.clear()
        cfg = load_config(TINY, ["train.steps=8", "checkpoint.dir=/x", "checkpoint.every=3", *overrides])
        r = SimpleNamespace(cfg=cfg, setup=SimpleNamespace(mesh=None, state_shardings=SimpleNamespace(params=None)),
                            watchdog=reliability.Watchdog(cfg.reliability))
        integrity = checks.Integrity.__new__(checks.Integrity)
        integrity.fingerprint = None
        replay = checks.Replay()
        for s in range(1, 9):
            replay.before_dispatch(r, s, None, None)
            integrity.after_step(r, StepInfo(s, SimpleNamespace(params={}), {}, False, s == 8))
        return list(replayed), sorted(set(checked))

    from maxtrain.run import StepInfo

    assert run("reliability.replay_every=0", "reliability.fingerprint_every=0") == ([], [])
    assert run("reliability.replay_every=4", "reliability.fingerprint_every=5") == ([4, 8], [3, 5, 6, 8])


def test_profile_start_step_null_traces_nothing(tmp_path):
    from maxtrain.metrics import ProfileWindow

    window = ProfileWindow(ProfileConfig(start_step=None, steps=3), str(tmp_path))
    assert [window.run(s, lambda x: x + 1, s) for s in range(1, 7)] == [2, 3, 4, 5, 6, 7]
    assert not window.active and not (tmp_path / "profile").exists()


def test_drill_steps_null_are_off_and_zero_is_the_first_step():
    """drills.*_step are 0-based steps: 0 fires at the first step, null never."""
    from maxtrain.reliability import drills

    grads, metrics = {"w": jnp.ones(3)}, {"loss": jnp.float32(2.0), "grad_norm": jnp.float32(1.0)}
    off = drills.step_faults(DrillsConfig())
    for step in range(2):
        g, m = off(grads, metrics, jnp.int32(step))
        assert float(m["loss"]) == 2.0 and (np.asarray(g["w"]) == 1).all()
    nan0 = drills.step_faults(DrillsConfig(nan_step=0, spike_step=1))
    losses = [float(nan0(grads, metrics, jnp.int32(s))[1]["loss"]) for s in range(3)]
    assert np.isnan(losses[0]) and losses[1:] == [2000.0, 2.0]


# ---------------------------------------------------------------- sharding


def test_null_sharding_rules_replicate_and_keep_the_other_defaults():
    """A rule `null` (or a name without a rule) replicates that dimension; a null inside a list
    is skipped; a config's `sharding.params.embed=null` replaces that rule alone."""
    from jax.sharding import PartitionSpec as P

    from maxtrain.sharding import logical_to_spec

    rules = {"embed": None, "vocab": [None, "tensor"], "mlp": ["fsdp", "tensor"]}
    assert logical_to_spec(("embed", "vocab", "other", None), rules) == P(None, "tensor", None, None)
    assert logical_to_spec(("mlp", "vocab"), rules) == P(("fsdp", "tensor"), None)  # tensor already used
    cfg = load_config(None, ["sharding.params.embed=null"])
    assert cfg.sharding.params["embed"] is None and cfg.sharding.params["mlp"] == "tensor"
    assert logical_to_spec(("layers", "embed", "mlp"), cfg.sharding.params) == P(None, None, "tensor")


# ---------------------------------------------------------------- checkpoints


def test_keep_every_null_keeps_only_the_newest(tmp_path):
    """checkpoint.keep_every null: nothing is kept forever, only the newest `keep` complete ones."""
    from maxtrain.checkpoint import Checkpointer
    from maxtrain.config import CheckpointConfig

    ck = Checkpointer(str(tmp_path / "ck"), CheckpointConfig(dir=str(tmp_path / "ck"), keep=1, keep_every=None))
    try:
        for step in (1, 2, 3):
            ck.save(step, {"w": jnp.arange(2.0) + step}, None, {})
        ck.wait()
        assert ck.steps() == [3]
    finally:
        ck.close()
