"""`maxtrain inspect`: the collectives each strategy compiles to, and the HLO accounting itself."""

import json
import os
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE, ROOT, SMALL, TINY
from maxtrain import load_config
from maxtrain.analysis.hlo import collective_stats, custom_call_counts
from maxtrain.analysis.inspect import inspect_step

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


# Gradient accumulation over 4 microbatches as XLA:GPU compiles it: the first iteration peeled off
# (run once in the entry), the loop left without a known_trip_count, its condition `i < 3` inside a
# fusion, `i` starting at a copied constant 0. Counted as one iteration, the step's FLOPs and
# collectives came out 2x short and a 70B plan read 441% MFU.
PEELED = """
%fused_compare (param_0: s32[]) -> pred[] {
  %param_0 = s32[] parameter(0)
  %c3 = s32[] constant(3)
  ROOT %lt = pred[] compare(%param_0, %c3), direction=LT
}

%cond (cp: (s32[], f32[8])) -> pred[] {
  %cp = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%cp), index=0
  ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[64,16]{1,0} all-gather(f32[8,16]{1,0} %x), channel_id=1, dimensions={0}
}

%cond_le (cp: (s32[], f32[8])) -> pred[] {
  %cp = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%cp), index=0
  %c5 = s32[] constant(5)
  ROOT %le = pred[] compare(%i, %c5), direction=LE
}

%body_le (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %rs = f32[2,16]{1,0} reduce-scatter(f32[16,16]{1,0} %x), channel_id=4, dimensions={0}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %ag0 = f32[64,16]{1,0} all-gather(f32[8,16]{1,0} %x), channel_id=2, dimensions={0}
  %zero = s32[] constant(0)
  %z = s32[] copy(%zero)
  %t = (s32[], f32[8]) tuple(%z, %a)
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
  %two = s32[] constant(2)
  %t2 = (s32[], f32[8]) tuple(%two, %a)
  %w2 = (s32[], f32[8]) while(%t2), condition=%cond_le, body=%body_le
}
"""


def test_a_peeled_loop_runs_the_trip_count_its_condition_reads():
    s = collective_stats(PEELED)
    assert s["all-gather"] == {"count": 1 + 3, "bytes": 4 * 64 * 16 * 4}  # peeled + 3 (0, 1, 2 < 3)
    assert s["reduce-scatter"] == {"count": 4, "bytes": 4 * 2 * 16 * 4}  # 2, 3, 4, 5 <= 5


# the induction variable in the fusion's second operand (element 1 of the loop tuple, starting at 0,
# while element 0 starts at 100), and a condition written constant-first (`5 > i`, i from 1)
INDEXED = """
%fused_compare (param_0: s32[], param_1: s32[]) -> pred[] {
  %param_0 = s32[] parameter(0)
  %param_1 = s32[] parameter(1)
  %c3 = s32[] constant(3)
  ROOT %lt = pred[] compare(%param_1, %c3), direction=LT
}

%cond (cp: (s32[], s32[])) -> pred[] {
  %cp = (s32[], s32[]) parameter(0)
  %other = s32[] get-tuple-element(%cp), index=0
  %i = s32[] get-tuple-element(%cp), index=1
  ROOT %f = pred[] fusion(%other, %i), kind=kLoop, calls=%fused_compare
}

%body (p: (s32[], s32[])) -> (s32[], s32[]) {
  %ag = f32[64,16]{1,0} all-gather(f32[8,16]{1,0} %x), channel_id=1, dimensions={0}
}

%cond_gt (cp: (s32[], f32[8])) -> pred[] {
  %cp = (s32[], f32[8]) parameter(0)
  %c5 = s32[] constant(5)
  %i = s32[] get-tuple-element(%cp), index=0
  ROOT %gt = pred[] compare(%c5, %i), direction=GT
}

%body_gt (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %rs = f32[2,16]{1,0} reduce-scatter(f32[16,16]{1,0} %x), channel_id=4, dimensions={0}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %hundred = s32[] constant(100)
  %zero = s32[] constant(0)
  %t = (s32[], s32[]) tuple(%hundred, %zero)
  %w = (s32[], s32[]) while(%t), condition=%cond, body=%body
  %one = s32[] constant(1)
  %t2 = (s32[], f32[8]) tuple(%one, %a)
  %w2 = (s32[], f32[8]) while(%t2), condition=%cond_gt, body=%body_gt
}
"""


def test_a_loop_bound_is_read_from_the_compared_operand_either_way_round():
    s = collective_stats(INDEXED)
    assert s["all-gather"]["count"] == 3  # element 1 runs 0, 1, 2; element 0's 100 is not the counter
    assert s["reduce-scatter"]["count"] == 4  # 5 > i for i = 1, 2, 3, 4


def _inspect(*mesh):
    return inspect_step(load_config(TINY, SMALL + list(mesh)))


# Each strategy's compiled step, pinned: the activation specs the model asks for (read from the
# traced program, the same on every jax) and the collectives XLA emits (kinds, counts and bytes,
# per jaxlib version: another XLA may schedule differently). A wrong activation rule or a constrain
# call on the wrong axes changes the specs even where every parity test still passes.
# MAXTRAIN_UPDATE_GOLDENS=1 rewrites the goldens (review the diff: it is the change you made).
GOLDENS = os.path.join(os.path.dirname(__file__), "goldens")
STRATEGIES = {
    "data": ["mesh.data=8"],
    "fsdp": ["mesh.data=1", "mesh.fsdp=8"],
    "tensor": ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"],
    "sequence": ["mesh.data=1", "mesh.fsdp=2", "mesh.sequence=4"],
    "ring": ["mesh.data=1", "mesh.fsdp=2", "mesh.sequence=4", "model.attention=ring"],
    "expert": ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=4", "model.moe={num_experts: 4, capacity_factor: 2}",
               "model.n_kv_heads=4"],
    "pipeline": ["mesh.data=2", "mesh.fsdp=2", "mesh.pipeline=2", "train.microbatches=4"],
}


def _nonzero(collectives: dict) -> dict:
    return {k: [v["count"], v["bytes"]] for k, v in collectives.items() if v["count"]}


def _diff(want: dict, got: dict) -> str:
    keys = sorted(set(want) | set(got))
    return "; ".join(f"{k}: golden {want.get(k)} now {got.get(k)}" for k in keys if want.get(k) != got.get(k))


def _hand_checks(name: str, r: dict) -> None:
    """What each strategy must compile to, whatever the golden says."""
    c, specs = r["collectives"], r["activation_shardings"]
    residual = [k for k in specs if k.startswith("f32[16,32,64] ")]  # batch, length, embed
    if name == "data":
        assert c["all-reduce"]["count"] > 0 and c["all-gather"]["count"] == 0  # replicated params
        assert residual == ["f32[16,32,64] data,-,-"], residual
    if name == "fsdp":
        assert c["all-gather"]["count"] > 0  # weights gathered before use
        # the gathered weights are bigger than anything all-reduced: gradients are not all-reduced whole
        assert c["all-gather"]["bytes"] > c["all-reduce"]["bytes"]
        state_bytes = 3 * 4 * r["params"]  # f32 parameters and two Adam moments
        assert r["memory_per_device"]["arguments"] < state_bytes / 4  # sharded 8 ways, plus the batch
        # the residual stream, and the embedding read where the table is stored (D split over fsdp,
        # all rows' ids gathered): no device builds the whole table or its float32 gradient
        assert sorted(residual) == ["f32[16,32,64] -,-,fsdp", "f32[16,32,64] fsdp,-,-"], residual
    if name == "tensor":
        assert "f32[16,32,128] fsdp,-,tensor" in specs  # the MLP's hidden units split over tensor
    if name == "sequence":
        assert "f32[16,32,64] fsdp,sequence,-" in specs and "f32[16,32,2,16] fsdp,-,-,-" in specs  # K/V gathered
    if name == "ring":
        assert c["collective-permute"]["count"] >= 2 * 2 * 3  # 2 layers x (fwd + bwd) x 3 hops
    if name == "expert":
        assert c["all-to-all"]["count"] >= 2 * 2 * 2  # 2 layers x (dispatch + combine) x (fwd + bwd)
        assert sorted(residual) == ["f32[16,32,64] expert,-,fsdp", "f32[16,32,64] fsdp+expert,-,-"], residual
        # tokens split over experts too (the first: the embedding read on its stored shard)
    if name == "pipeline":
        assert c["collective-permute"]["count"] > 0  # activations handed stage to stage


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_compiles_to_its_golden(name):
    import jaxlib
    r = _inspect(*STRATEGIES[name])
    _hand_checks(name, r)
    path = os.path.join(GOLDENS, f"{name}.json")
    version = f"jaxlib-{jaxlib.__version__}"
    got_specs, got_coll = r["activation_shardings"], _nonzero(r["collectives"])
    golden = json.load(open(path)) if os.path.exists(path) else {"collectives": {}}
    if os.environ.get("MAXTRAIN_UPDATE_GOLDENS") == "1":
        golden.update(overrides=STRATEGIES[name], activation_shardings=got_specs)
        golden["collectives"][version] = got_coll
        os.makedirs(GOLDENS, exist_ok=True)
        with open(path, "w") as f:
            json.dump(golden, f, indent=1, sort_keys=True)
            f.write("\n")
    assert os.path.exists(path), f"no golden {path}: run with MAXTRAIN_UPDATE_GOLDENS=1"
    assert golden["overrides"] == STRATEGIES[name], "the strategy changed: regenerate its golden"
    assert got_specs == golden["activation_shardings"], _diff(golden["activation_shardings"], got_specs)
    if version not in golden["collectives"]:
        pytest.skip(f"{name}: no collectives golden for {version} (have {sorted(golden['collectives'])}); "
                    "MAXTRAIN_UPDATE_GOLDENS=1 adds one")
    assert got_coll == golden["collectives"][version], _diff(golden["collectives"][version], got_coll)


def _ring_hlo(*overrides):
    from maxtrain.mesh import use_mesh
    from maxtrain.step import compile_train_step, make_setup
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
    from maxtrain.analysis.inspect import inspect_step
    overrides = SMALL + ["model.attention=ring", "train.seq_len=256", "model.remat=none", "mesh.data=1",
                         "mesh.fsdp=2"]
    temps = [inspect_step(load_config(TINY, overrides + [f"mesh.sequence={n}"]), devices=jax.devices()[:2 * n])
             ["memory_per_device"]["temporaries"] for n in (1, 4)]
    assert temps[0] > 2.5 * temps[1], temps  # activations (and attention's blocks) scale as L / n


def test_cli_inspect_json_for_a_target_device_count():
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE.strip()}  # the 4 devices are --devices's, not this process's 8
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


ROOFLINE_HLO = """
HloModule step

%fused_slice (param_0: bf16[4,8,16], param_1: s32[]) -> bf16[8,16] {
  %param_0 = bf16[4,8,16]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %bc = bf16[4,8,16]{2,1,0} bitcast(%param_0)
  %ds = bf16[1,8,16]{2,1,0} dynamic-slice(%bc, %param_1, %c, %c), dynamic_slice_sizes={1,8,16}
  ROOT %b = bf16[8,16]{1,0} bitcast(%ds)
}

%fused_update (param_0: bf16[4,8,16], param_1: bf16[1,8,16], param_2: s32[]) -> bf16[4,8,16] {
  %param_0 = bf16[4,8,16]{2,1,0} parameter(0)
  %param_1 = bf16[1,8,16]{2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %dus = bf16[4,8,16]{2,1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %c, %c)
}

%fused_dot (param_0: bf16[8,16], param_1: bf16[16,32]) -> bf16[8,32] {
  %param_0 = bf16[8,16]{1,0} parameter(0)
  %param_1 = bf16[16,32]{1,0} parameter(1)
  ROOT %dot = bf16[8,32]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], bf16[4,8,16], bf16[16,32], bf16[1,8,16], f32[16])) -> (s32[], bf16[4,8,16]) {
  %p = (s32[], bf16[4,8,16]{2,1,0}, bf16[16,32]{1,0}, bf16[1,8,16]{2,1,0}, f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = bf16[4,8,16]{2,1,0} get-tuple-element(%p), index=1
  %w = bf16[16,32]{1,0} get-tuple-element(%p), index=2
  %u = bf16[1,8,16]{2,1,0} get-tuple-element(%p), index=3
  %g = f32[16]{0} get-tuple-element(%p), index=4
  %x = bf16[8,16]{1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_slice
  %y = bf16[8,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(step)/transpose(jvp())/while/body/dot_general"}
  %new = bf16[4,8,16]{2,1,0} fusion(%stack, %u, %i), kind=kLoop, calls=%fused_update
  %ag = f32[64]{0} all-gather(%g), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %t = (s32[], bf16[4,8,16]{2,1,0}) tuple(%i, %new)
}

ENTRY %main (a: bf16[8,16], b: bf16[16,32], t0: (s32[], bf16[4,8,16])) -> bf16[8,32] {
  %a = bf16[8,16]{1,0} parameter(0)
  %b = bf16[16,32]{1,0} parameter(1)
  %t0 = (s32[], bf16[4,8,16]{2,1,0}) parameter(2)
  %loop = (s32[], bf16[4,8,16]{2,1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %cb = (bf16[8,32]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
}
"""


def test_roofline_reads_slices_writes_updates_and_counts_matmuls():
    from maxtrain.analysis import hlo

    r = hlo.roofline(ROOFLINE_HLO, peak_flops=1e12, bandwidth=1e9, link_bandwidth=1e8, network_bandwidth=1e7,
                     devices_per_host=4)
    k = {x.name: x for x in r.kernels}
    assert set(k) == {"x", "y", "new", "ag", "cb"}
    assert k["x"].runs == k["y"].runs == k["new"].runs == k["ag"].runs == 4 and k["cb"].runs == 1
    assert k["x"].bytes == 8 * 16 * 2 + 4 + 8 * 16 * 2  # the slice (through a bitcast), not the stack
    assert k["new"].bytes == 8 * 16 * 2 + 4 + 8 * 16 * 2  # in place: the update read and written
    assert k["y"].flops == 2 * 8 * 32 * 16 and k["y"].category == "matmul" and k["y"].op == "bwd while/body/dot_general"
    assert k["cb"].flops == 2 * 8 * 32 * 16 and k["cb"].bytes == (8 * 16 + 16 * 32 + 8 * 32) * 2  # no workspace
    assert k["ag"].bytes == 64 * 4 * 3 / 4 and k["ag"].seconds == k["ag"].bytes / 1e8  # groups within a host
    assert k["x"].seconds == k["x"].bytes / 1e9 and k["x"].bound == "memory"
    assert r.seconds("collective") == 4 * k["ag"].seconds
    assert r.step_s == r.compute_s == sum(x.seconds * x.runs for n, x in k.items() if n != "ag")
    spread = hlo.roofline(ROOFLINE_HLO, peak_flops=1e12, bandwidth=1e9, link_bandwidth=1e8, network_bandwidth=1e7,
                          devices_per_host=2)
    assert {x.name: x for x in spread.kernels}["ag"].seconds == k["ag"].bytes / 1e7  # across hosts: the NIC


FP8_HLO = """
HloModule step

%fp8_gemm (p0: f8e4m3fn[64,32], p1: f8e4m3fn[32,16], p2: f32[]) -> bf16[64,16] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{0,1} parameter(1)
  %p2 = f32[] parameter(2)
  %d = f32[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %s = f32[64,16]{1,0} broadcast(%p2), dimensions={}
  %m = f32[64,16]{1,0} multiply(%d, %s)
  ROOT %c = bf16[64,16]{1,0} convert(%m)
}

%dequantized (p0: f8e4m3fn[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  %up = bf16[64,32]{1,0} convert(%p0)
  ROOT %d = bf16[64,16]{1,0} dot(%up, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f8e4m3fn[64,32], b: f8e4m3fn[32,16], s: f32[], w: bf16[32,16]) -> (bf16[64,16], bf16[64,16], bf16[64,16]) {
  %a = f8e4m3fn[64,32]{1,0} parameter(0)
  %b = f8e4m3fn[32,16]{0,1} parameter(1)
  %s = f32[] parameter(2)
  %w = bf16[32,16]{1,0} parameter(3)
  %q = bf16[64,16]{1,0} fusion(%a, %b, %s), kind=kCustom, calls=%fp8_gemm
  %dq = bf16[64,16]{1,0} fusion(%a, %w), kind=kCustom, calls=%dequantized
  %lt = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%a, %b, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %t = (bf16[64,16]{1,0}, bf16[64,16]{1,0}, bf16[64,16]{1,0}) tuple(%q, %dq, %dq)
}
"""


def test_roofline_counts_fp8_gemms_at_the_fp8_peak_and_a_dequantized_one_as_bf16():
    from maxtrain.analysis import hlo

    r = hlo.roofline(FP8_HLO, peak_flops=1e12, bandwidth=1e15, link_bandwidth=1e8, fp8_peak_flops=2e12)
    k = {x.name: x for x in r.kernels}
    flops = 2 * 64 * 16 * 32
    assert k["q"].precision == "fp8" and k["lt"].precision == "fp8" and k["dq"].precision == "bf16"
    assert k["q"].flops == k["lt"].flops == k["dq"].flops == flops and k["lt"].category == "matmul"
    assert k["q"].seconds == flops / 2e12 and k["dq"].seconds == flops / 1e12  # compute-bound at this bandwidth
    g = r.gemms()
    assert (g["fp8"]["kernels"], g["fp8"]["flops"], g["bf16"]["kernels"]) == (2, 2 * flops, 1)


@pytest.mark.parametrize("text, groups", [
    ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups={{0,2},{1,3}}", [[0, 2], [1, 3]]),
    ("source_target_pairs={{0,1},{1,0}}", [[0, 1], [1, 0]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2,'axis_2'=1] {'axis_0'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_0'}",
     [[0, 1], [2, 3], [4, 5], [6, 7]]),
])
def test_replica_groups_both_spellings(text, groups):
    from maxtrain.analysis import hlo

    inst = hlo.Instruction("ag", "all-gather", "f32[8]{0}", ("x",), ", channel_id=1, " + text)
    assert hlo.replica_groups(inst) == groups


def test_roofline_flops_of_a_sharded_step_are_the_models():
    """fsdp=4 x tensor=2 on 8 CPU devices: the matmul FLOPs the roofline finds in one device's
    program are the model's count over 8, plus the masked half of XLA attention's scores."""
    from maxtrain.analysis import hlo
    from maxtrain.mesh import use_mesh
    from maxtrain.step import compile_train_step, make_setup

    cfg = load_config(TINY, SMALL + ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "model.remat=none"])
    setup = make_setup(cfg)
    with use_mesh(setup.mesh):
        text = compile_train_step(setup)[0].as_text()
    r = hlo.roofline(text, peak_flops=1e15, bandwidth=1e12, link_bandwidth=1e11)
    m, L = cfg.model, cfg.train.seq_len
    masked = 3 * m.n_layers * 4 * m.n_heads * m.head_dim * (L - (L + 1) / 2) * cfg.train.batch_size * L
    assert sum(k.flops * k.runs for k in r.kernels) == pytest.approx((setup.flops_per_step + masked) / 8, rel=1e-9)
    assert {k.category for k in r.kernels} >= {"matmul", "fusion", "collective"}
    assert r.summary(setup.flops_per_step / 8)["mfu_ceiling"] > 0


# jax >= 0.11's GPU compiler: a stacking dynamic-update-slice runs as an asynchronous fusion
# (`fusion-start`/`fusion-done`), and a custom call whose operands are slices of stacked buffers is
# wrapped in a `dynamic-slice-fusion` (kind=kCustom); a scanned layer's flash dQ kernel, as it writes.
ASYNC_HLO = """
HloModule step

%fused_update (param_0: bf16[4,8,256], param_1: bf16[8,256], param_2: s32[]) -> bf16[4,8,256] {
  %param_0 = bf16[4,8,256]{2,1,0} parameter(0)
  %param_1 = bf16[8,256]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %b = bf16[1,8,256]{2,1,0} bitcast(%param_1)
  ROOT %dus = bf16[4,8,256]{2,1,0} dynamic-update-slice(%param_0, %b, %param_2, %c, %c)
}

%dynamic-slice-fusion (p0: bf16[4,2,128,4,64], p1: s32[], p2: bf16[2,128,4,64], p3: bf16[2,128,2,64]) -> bf16[2,128,4,64] {
  %p0 = bf16[4,2,128,4,64]{4,3,2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[2,128,4,64]{3,2,1,0} parameter(2)
  %p3 = bf16[2,128,2,64]{3,2,1,0} parameter(3)
  %c = s32[] constant(0)
  %ds = bf16[1,2,128,4,64]{4,3,2,1,0} dynamic-slice(%p0, %p1, %c, %c, %c, %c), dynamic_slice_sizes={1,2,128,4,64}
  %q = bf16[2,128,4,64]{3,2,1,0} bitcast(%ds)
  ROOT %dq = bf16[2,128,4,64]{3,2,1,0} custom-call(%q, %p3, %p2), custom_call_target="mosaic_gpu_v2"
}

%cond (p: (s32[], bf16[4,8,256], bf16[8,256], bf16[4,2,128,4,64], bf16[2,128,4,64], bf16[2,128,2,64])) -> pred[] {
  %p = (s32[], bf16[4,8,256]{2,1,0}, bf16[8,256]{1,0}, bf16[4,2,128,4,64]{4,3,2,1,0}, bf16[2,128,4,64]{3,2,1,0}, bf16[2,128,2,64]{3,2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], bf16[4,8,256], bf16[8,256], bf16[4,2,128,4,64], bf16[2,128,4,64], bf16[2,128,2,64])) -> (s32[], bf16[4,8,256]) {
  %p = (s32[], bf16[4,8,256]{2,1,0}, bf16[8,256]{1,0}, bf16[4,2,128,4,64]{4,3,2,1,0}, bf16[2,128,4,64]{3,2,1,0}, bf16[2,128,2,64]{3,2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = bf16[4,8,256]{2,1,0} get-tuple-element(%p), index=1
  %u = bf16[8,256]{1,0} get-tuple-element(%p), index=2
  %qs = bf16[4,2,128,4,64]{4,3,2,1,0} get-tuple-element(%p), index=3
  %do = bf16[2,128,4,64]{3,2,1,0} get-tuple-element(%p), index=4
  %k = bf16[2,128,2,64]{3,2,1,0} get-tuple-element(%p), index=5
  %fs = ((bf16[4,8,256]{2,1,0}, bf16[8,256]{1,0}, s32[]), bf16[4,8,256]{2,1,0}, u32[]) fusion-start(%stack, %u, %i), kind=kLoop, calls=%fused_update
  %fd = bf16[4,8,256]{2,1,0} fusion-done(%fs)
  %dq = bf16[2,128,4,64]{3,2,1,0} fusion(%qs, %i, %do, %k), kind=kCustom, calls=%dynamic-slice-fusion
  ROOT %t = (s32[], bf16[4,8,256]{2,1,0}) tuple(%i, %fd)
}

ENTRY %main (t0: (s32[], bf16[4,8,256], bf16[8,256], bf16[4,2,128,4,64], bf16[2,128,4,64], bf16[2,128,2,64])) -> (s32[], bf16[4,8,256]) {
  %t0 = (s32[], bf16[4,8,256]{2,1,0}, bf16[8,256]{1,0}, bf16[4,2,128,4,64]{4,3,2,1,0}, bf16[2,128,4,64]{3,2,1,0}, bf16[2,128,2,64]{3,2,1,0}) parameter(0)
  ROOT %loop = (s32[], bf16[4,8,256]{2,1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_roofline_reads_async_fusions_and_custom_calls_inside_fusions():
    """An async fusion is one kernel (its -done is free) writing only its update in place, and a
    flash kernel inside a dynamic-slice-fusion is still attention, counted per loop iteration
    (on jax 0.11 these read as whole-stack writes of 'fusion' and the bound of the 1B step doubled)."""
    from maxtrain.analysis import hlo

    r = hlo.roofline(ASYNC_HLO, peak_flops=1e12, bandwidth=1e9, link_bandwidth=1e8)
    k = {x.name: x for x in r.kernels}
    assert set(k) == {"fs", "dq", "lt"}
    assert k["fs"].runs == k["dq"].runs == 4
    assert k["fs"].bytes == 8 * 256 * 2 + 4 + 8 * 256 * 2 and k["fs"].category == "fusion"
    B, L, H, D = 2, 128, 4, 64
    assert k["dq"].category == "attention" and k["dq"].flops == 2 * 3 * B * H * L * L * D * (L + 1) / (2 * L)
    assert k["dq"].bytes == 2 * (3 * B * L * H * D + B * L * 2 * D) + 4  # the q slice, not the stack
    assert custom_call_counts(ASYNC_HLO) == {"mosaic_gpu_v2": 4}


def test_sequence_parallel_gathers_activations_along_the_leading_dimension():
    """Megatron sequence parallelism (`length: [sequence, tensor]`): a block gathers its normed input
    along length. Laid out `[B, L, D]` that is a gather along the middle dimension, which XLA copies
    through a transpose before and after (751 ms of the 70B bound on H100s); the blocks run
    length-major (`llama._enter_block`), so every activation gather concatenates leading slabs."""
    from maxtrain.mesh import use_mesh
    from maxtrain.step import compile_train_step, make_setup
    setup = make_setup(load_config(TINY, SMALL + ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2",
                                                  "sharding.activations.length=[sequence, tensor]"]))
    with use_mesh(setup.mesh):
        hlo = compile_train_step(setup)[0].as_text()
    L, D = 32, 64  # SMALL's train.seq_len and model.d_model
    gathers = [line.strip() for line in hlo.splitlines()  # in the layers' loop (the head's gather is once a step)
               if " all-gather(" in line and f"{L}," in line and f",{D}]" in line and "while/body" in line]
    assert gathers, "no activation all-gather: the layout is not sequence parallel"
    assert all(f"f32[{L}," in g and "dimensions={0}" in g for g in gathers), "\n".join(gathers)
