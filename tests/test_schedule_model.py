"""The schedule model (`maxtrain.analysis.schedule`) on small hand-written scheduled HLO programs,
against answers computed by hand: what hides a collective, what exposes it, a loop's and a
conditional's share, and the figures `predict` reads from the roofline."""

import dataclasses

import pytest

from maxtrain.analysis import hlo, schedule

MS = 1e-3


def _module(body: str, extra: str = "") -> hlo.Module:
    return hlo.parse(f"HloModule m, is_scheduled=true\n\n{extra}\nENTRY %main (p: f32[1024]) -> f32[1024] {{\n"
                     f"{body}\n}}\n")


def _sim(module, **seconds):
    return schedule.simulate(module, {k.replace("_", "-"): v * MS for k, v in seconds.items()})


GROUP = "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}"


def test_a_collective_is_hidden_by_the_kernels_between_its_start_and_its_done():
    m = _module(f"""
  %p = f32[1024]{{0}} parameter(0)
  %ag-start = (f32[128]{{0}}, f32[1024]{{0}}) all-gather-start(f32[1024]{{0}} %p), {GROUP}
  %k1 = f32[1024]{{0}} fusion(f32[1024]{{0}} %p), kind=kLoop, calls=%f
  %ag-done = f32[1024]{{0}} all-gather-done((f32[128]{{0}}, f32[1024]{{0}}) %ag-start)
  ROOT %k2 = f32[1024]{{0}} fusion(f32[1024]{{0}} %ag-done), kind=kLoop, calls=%f""")
    span = _sim(m, ag_start=1.0, k1=2.0, k2=1.0)
    assert span.duration == pytest.approx(3 * MS) and span.exposed == 0
    assert span.compute == pytest.approx(3 * MS) and span.collective == pytest.approx(1 * MS)
    # the same collective with a shorter kernel in between: 1.0 - 0.4 exposed
    span = _sim(m, ag_start=1.0, k1=0.4, k2=1.0)
    assert span.exposed == pytest.approx(0.6 * MS) and span.duration == pytest.approx(2.0 * MS)
    assert span.by["ag-start"] == pytest.approx([0.6 * MS, 1.0 * MS])


def test_collectives_share_one_stream_and_a_synchronous_one_is_exposed_whole():
    m = _module(f"""
  %p = f32[1024]{{0}} parameter(0)
  %a-start = f32[1024]{{0}} all-reduce-start(f32[1024]{{0}} %p), {GROUP}, to_apply=%add
  %b-start = f32[1024]{{0}} all-reduce-start(f32[1024]{{0}} %p), {GROUP}, to_apply=%add
  %k1 = f32[1024]{{0}} fusion(f32[1024]{{0}} %p), kind=kLoop, calls=%f
  %a-done = f32[1024]{{0}} all-reduce-done(f32[1024]{{0}} %a-start)
  %b-done = f32[1024]{{0}} all-reduce-done(f32[1024]{{0}} %b-start)
  %sync = f32[1024]{{0}} all-reduce(f32[1024]{{0}} %k1), {GROUP}, to_apply=%add
  ROOT %k2 = f32[1024]{{0}} fusion(f32[1024]{{0}} %sync), kind=kLoop, calls=%f""")
    # a: 0-1 ms (hidden by k1, 0-1.5), b waits for the stream: 1-2 ms, done at 1.5 -> 0.5 exposed;
    # sync: 2.0-2.25 on the compute stream's clock, exposed whole; k2: 2.25-3.25
    span = _sim(m, a_start=1.0, b_start=1.0, k1=1.5, sync=0.25, k2=1.0)
    assert span.by["a-start"][0] == 0
    assert span.by["b-start"][0] == pytest.approx(0.5 * MS)
    assert span.by["sync"][0] == pytest.approx(0.25 * MS)
    assert span.exposed == pytest.approx(0.75 * MS)
    assert span.duration == pytest.approx(3.25 * MS) == pytest.approx(span.compute + span.exposed)


def test_a_loop_runs_its_trip_count_and_a_conditional_its_branch_shares():
    comps = f"""
%cond (c: (s32[], f32[1024])) -> pred[] {{
  %c = (s32[], f32[1024]{{0}}) parameter(0)
  ROOT %lt = pred[] fusion((s32[], f32[1024]{{0}}) %c), kind=kLoop, calls=%f
}}

%body (b: (s32[], f32[1024])) -> (s32[], f32[1024]) {{
  %b = (s32[], f32[1024]{{0}}) parameter(0)
  %x = f32[1024]{{0}} get-tuple-element((s32[], f32[1024]{{0}}) %b), index=1
  %rs-start = ((f32[1024]{{0}}), f32[128]{{0}}) reduce-scatter-start(f32[1024]{{0}} %x), {GROUP}, to_apply=%add
  %mm = f32[1024]{{0}} fusion(f32[1024]{{0}} %x), kind=kCustom, calls=%f
  %rs-done = f32[128]{{0}} reduce-scatter-done(((f32[1024]{{0}}), f32[128]{{0}}) %rs-start)
  ROOT %t = (s32[], f32[1024]{{0}}) tuple(s32[] %i, f32[1024]{{0}} %mm)
}}

%b0 (x0: f32[1024]) -> f32[1024] {{
  %x0 = f32[1024]{{0}} parameter(0)
  ROOT %idle = f32[1024]{{0}} fusion(f32[1024]{{0}} %x0), kind=kLoop, calls=%f
}}

%b1 (x1: f32[1024]) -> f32[1024] {{
  %x1 = f32[1024]{{0}} parameter(0)
  %cp-start = (f32[1024]{{0}}, f32[1024]{{0}}, u32[], u32[]) collective-permute-start(f32[1024]{{0}} %x1), source_target_pairs={{0,1}}
  %cp-done = f32[1024]{{0}} collective-permute-done((f32[1024]{{0}}, f32[1024]{{0}}, u32[], u32[]) %cp-start)
  ROOT %work = f32[1024]{{0}} fusion(f32[1024]{{0}} %cp-done), kind=kLoop, calls=%f
}}
"""
    m = _module("""
  %p = f32[1024]{0} parameter(0)
  %init = (s32[], f32[1024]{0}) tuple(s32[] %zero, f32[1024]{0} %p)
  %w = (s32[], f32[1024]{0}) while((s32[], f32[1024]{0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %y = f32[1024]{0} get-tuple-element((s32[], f32[1024]{0}) %w), index=1
  ROOT %sw = f32[1024]{0} conditional(s32[] %i, f32[1024]{0} %y, f32[1024]{0} %y), branch_computations={%b0, %b1}""",
                comps)
    # per iteration: condition 0.1 ms; body: rs 1.0 ms over a 0.7 ms matmul -> 0.3 ms exposed
    # conditional: b0 0.5 ms a quarter of the time, b1 (0.2 ms permute exposed whole + 1 ms) three quarters
    m = dataclasses.replace(m, branch_shares={2: [0.25, 0.75]})
    span = _sim(m, lt=0.1, rs_start=1.0, mm=0.7, idle=0.5, cp_start=0.2, work=1.0)
    loop = 4 * (0.1 + 0.7 + 0.3)
    branch = 0.25 * 0.5 + 0.75 * (0.2 + 1.0)
    assert span.duration == pytest.approx((loop + branch) * MS)
    assert span.exposed == pytest.approx((4 * 0.3 + 0.75 * 0.2) * MS)
    assert span.by["rs-start"] == pytest.approx([4 * 0.3 * MS, 4 * 1.0 * MS])
    assert span.collective == pytest.approx((4 * 1.0 + 0.75 * 0.2) * MS)
    # without shares a conditional counts every branch, as the roofline does
    span = _sim(dataclasses.replace(m, branch_shares={}), lt=0.1, rs_start=1.0, mm=0.7, idle=0.5, cp_start=0.2,
                work=1.0)
    assert span.duration == pytest.approx((loop + 0.5 + 1.2) * MS)


def test_predict_prices_kernels_and_collectives_from_the_roofline():
    """One fusion reading and writing 4 KiB at 1 GB/s (8.192 us), overlapped with an all-gather of
    4 KiB over 8 devices at 0.5 GB/s (7/8 x 4096 B: 7.168 us) plus a 10 us latency: 17.168 us of
    collective, 8.976 us exposed. The reduce-scatter-done and the all-gather-done are no kernels
    (the roofline once priced a reduce-scatter-done as a kernel moving its bytes)."""
    m = _module(f"""
  %p = f32[1024]{{0}} parameter(0)
  %ag-start = (f32[128]{{0}}, f32[1024]{{0}}) all-gather-start(f32[128]{{0}} %p), {GROUP}, metadata={{op_name="jit(step)/layer/all_gather"}}
  %k1 = f32[1024]{{0}} fusion(f32[1024]{{0}} %p), kind=kLoop, calls=%f
  %ag-done = f32[1024]{{0}} all-gather-done((f32[128]{{0}}, f32[1024]{{0}}) %ag-start)
  %rs-start = ((f32[1024]{{0}}), f32[128]{{0}}) reduce-scatter-start(f32[1024]{{0}} %ag-done), {GROUP}, to_apply=%add
  ROOT %rs-done = f32[128]{{0}} reduce-scatter-done(((f32[1024]{{0}}), f32[128]{{0}}) %rs-start)""",
                extra="%f (x: f32[1024]) -> f32[1024] {\n  %x = f32[1024]{0} parameter(0)\n"
                      "  ROOT %n = f32[1024]{0} negate(f32[1024]{0} %x)\n}\n")
    roof = hlo.roofline(m, peak_flops=1e12, bandwidth=1e9, link_bandwidth=0.5e9)
    assert {k.name for k in roof.kernels} == {"ag-start", "k1", "rs-start"}
    assert roof.compute_s == pytest.approx(8192 / 1e9)
    p = schedule.predict(m, roof, link_latency_s=10e-6)
    ag = 7 / 8 * 4096 / 0.5e9 + 10e-6
    rs = 7 / 8 * 4096 / 0.5e9 + 10e-6  # the reduce-scatter sends 7/8 of its 4 KiB operand
    assert p.compute_s == pytest.approx(8192 / 1e9)
    assert p.collective_s == pytest.approx(ag + rs)
    assert p.exposed_s == pytest.approx((ag - 8192 / 1e9) + rs)
    assert p.step_s == pytest.approx(p.compute_s + p.exposed_s) and p.step_s > roof.step_s
    assert [e.name for e in p.exposures] == ["rs-start", "ag-start"]
    assert p.exposures[1].op == "fwd jit(step)/layer/all_gather" and p.exposures[1].kind == "all-gather"
    assert p.exposed_by_kind() == pytest.approx({"reduce-scatter": rs, "all-gather": ag - 8192 / 1e9})
    summary = p.summary(model_flops_per_device=1e6)
    assert summary["predicted_mfu"] == pytest.approx(1e6 / (p.step_s * 1e12))
    assert summary["exposed_share"] == pytest.approx(p.exposed_s / p.step_s)


def test_a_collective_across_hosts_pays_the_network_latency():
    m = _module("""
  %p = f32[1024]{0} parameter(0)
  %in = f32[1024]{0} all-reduce(f32[1024]{0} %p), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %across = f32[1024]{0} all-reduce(f32[1024]{0} %in), replica_groups={{0,4}}, to_apply=%add""")
    roof = hlo.roofline(m, peak_flops=1e12, bandwidth=1e9, link_bandwidth=1e9, network_bandwidth=0.25e9,
                        devices_per_host=4)
    p = schedule.predict(m, roof, devices_per_host=4, link_latency_s=1e-6, network_latency_s=5e-6)
    within = 2 * 4096 * 3 / 4 / 1e9 + 1e-6
    across = 2 * 4096 * 1 / 2 / 0.25e9 + 5e-6
    assert p.exposed_s == pytest.approx(within + across) == pytest.approx(p.step_s)
