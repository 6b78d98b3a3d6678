"""`maxtrain inspect`: the collectives each strategy compiles to, and the HLO accounting itself."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, SMALL, TINY
from maxtrain import load_config
from maxtrain.metrics import collective_stats, custom_call_counts
from maxtrain.train import inspect_step

HLO = """
%body.1 (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[64,16]{1,0} all-gather(f32[8,16]{1,0} %x), channel_id=1, dimensions={0}
  %cp = bf16[4,8]{1,0} collective-permute-start(bf16[4,8]{1,0} %y), channel_id=2
  %cpd = bf16[4,8]{1,0} collective-permute-done(bf16[4,8]{1,0} %cp)
}

ENTRY %main.9 (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while((s32[], f32[8]) %t), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"3"}}
  %ar = (f32[10]{0}, f32[6]{0}) all-reduce(f32[10]{0} %g, f32[6]{0} %h), channel_id=3
}
"""


def test_collective_stats_counts_loop_iterations_and_bytes():
    s = collective_stats(HLO)
    assert s["all-gather"] == {"count": 3, "bytes": 3 * 64 * 16 * 4}
    assert s["collective-permute"] == {"count": 3, "bytes": 3 * 4 * 8 * 2}  # -done not counted again
    assert s["all-reduce"] == {"count": 1, "bytes": (10 + 6) * 4}
    assert s["reduce-scatter"]["count"] == 0


def test_custom_call_counts_count_loop_iterations():
    hlo = HLO.replace("  %cpd = ", '  %kb = f32[8]{0} custom-call(f32[8]{0} %x), custom_call_target="kernel_b"\n  %cpd = ')
    hlo = hlo.replace("  %ar = ", '  %ka = (f32[8]{0}, f32[2]{0}) custom-call(%a), custom_call_target="kernel_a", '
                                  'metadata={op_name="custom-call"}\n  %ar = ')
    assert custom_call_counts(hlo) == {"kernel_b": 3, "kernel_a": 1}  # body.1 runs 3 times
    assert custom_call_counts(HLO) == {}


def _inspect(*mesh):
    return inspect_step(load_config(TINY, SMALL + list(mesh)))


def test_strategies_emit_their_collectives():
    data = _inspect("mesh.data=8")["collectives"]
    assert data["all-reduce"]["count"] > 0 and data["all-gather"]["count"] == 0  # replicated params
    fsdp = _inspect("mesh.data=1", "mesh.fsdp=8")
    assert fsdp["collectives"]["all-gather"]["count"] > 0  # weights gathered before use
    # the gathered weights are bigger than anything all-reduced: gradients are not all-reduced whole
    assert fsdp["collectives"]["all-gather"]["bytes"] > fsdp["collectives"]["all-reduce"]["bytes"]
    assert fsdp["memory_per_device"]["arguments"] < _inspect("mesh.data=8")["memory_per_device"]["arguments"]
    ring = _inspect("mesh.data=1", "mesh.fsdp=2", "mesh.sequence=4", "model.attention=ring")
    assert ring["collectives"]["collective-permute"]["count"] >= 2 * 2 * 3  # 2 layers x (fwd + bwd) x 3 hops
    moe = _inspect("mesh.data=1", "mesh.fsdp=2", "mesh.expert=4", "model.moe={num_experts: 4, capacity_factor: 2}",
                   "model.n_kv_heads=4")
    assert moe["collectives"]["all-to-all"]["count"] >= 2 * 2 * 2  # 2 layers x (dispatch + combine) x (fwd + bwd)


def _ring_hlo(*overrides):
    from maxtrain.mesh import use_mesh
    from maxtrain.train import compile_train_step, make_setup
    setup = make_setup(load_config(TINY, SMALL + ["model.remat=none", "model.attention=ring", *overrides]))
    with use_mesh(setup.mesh):
        return compile_train_step(setup)[0].as_text()


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_sends_what_the_ring_needs_and_never_gathers_kv(layout):
    """Per layer and device: forward, n-1 hops of the K and V blocks; backward, n-1 hops of K, V and
    their dK/dV accumulators plus the accumulators' last hop home (segment ids are extra, small)."""
    n, B, L, G, K, layers = 4, 16 // 2, 32, 2, 16, 2  # SMALL on fsdp=2 x sequence=4, float32
    hlo = _ring_hlo("mesh.data=1", "mesh.fsdp=2", "mesh.sequence=4", f"model.ring_layout={layout}")
    block = B * (L // n) * G * K * 4
    need = layers * ((n - 1) * 2 * block + (n - 1) * 4 * block + 2 * block)
    sent = collective_stats(hlo)["collective-permute"]["bytes"]
    assert need <= sent <= 1.1 * need, (sent, need)
    kv_gathers = [line for line in hlo.splitlines() if " all-gather(" in line and f",{L},{G},{K}]" in line]
    assert not kv_gathers  # K/V are never gathered to full length


def test_ring_activation_memory_falls_with_sequence():
    import jax
    from maxtrain.train import inspect_step
    overrides = SMALL + ["model.attention=ring", "train.seq_len=256", "model.remat=none", "mesh.data=1",
                         "mesh.fsdp=2"]
    temps = [inspect_step(load_config(TINY, overrides + [f"mesh.sequence={n}"]), devices=jax.devices()[:2 * n])
             ["memory_per_device"]["temporaries"] for n in (1, 4)]
    assert temps[0] > 2.5 * temps[1], temps  # activations (and attention's blocks) scale as L / n


def test_cli_inspect_json_for_a_target_device_count():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "maxtrain.cli", "inspect", "--devices", "4", "--json", TINY, *SMALL,
                        "mesh.data=1", "mesh.fsdp=4"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4 and out["mesh"]["fsdp"] == 4 and out["params"] > 0
    assert out["memory_per_device"]["total"] > 0 and out["collectives"]["all-gather"]["count"] > 0


@pytest.mark.parametrize("bad", [["mesh.fsdp=3"]])
def test_inspect_bad_mesh_is_a_config_error(bad, capsys):
    from maxtrain import cli
    assert cli.main(["inspect", TINY, *bad]) == 2
    assert "does not divide the 8 devices" in capsys.readouterr().err
