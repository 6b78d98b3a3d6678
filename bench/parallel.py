"""Parallelism strategies side by side on 8 fake devices: compiled memory, collectives, step time.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/parallel.py [KEY=VALUE ...]
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/parallel.py --schedules [KEY=VALUE ...]

`--schedules` compares the pipeline schedules (`train.pipeline_schedule`) on 4 stages x 2-way data
parallelism with 16 microbatches instead, and gpipe against aligned 1F1B on 4 stages x 2-way
sequence parallelism (ring attention).

A fixed small Llama (and its MoE variant) on synthetic data; step time is measured on the CPU, so
compare it between rows, not with a GPU. The MoE row routes with the model's own router (natural
routing from its initialisation, dropless: no forced balance, no capacity), and prints the load
it measured (`moe_imbalance`: max/mean tokens per expert). The last line is one JSON object (a
list of rows).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax

from maxtrain import load_config
from maxtrain.config import pipeline_microbatches
from maxtrain.data import make_source
from maxtrain.mesh import use_mesh
from maxtrain.parallel import schedules
from maxtrain.analysis.hlo import collective_stats
from maxtrain.metrics import memory_breakdown
from maxtrain.step import compile_train_step, init_state, make_setup, put_batch

MODEL = ["model.vocab_size=512", "model.d_model=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
         "model.d_ff=768", "train.batch_size=16", "train.seq_len=256", "train.dtype=float32", "data.kind=synthetic",
         "model.remat=none"]
STRATEGIES = {
    "data=8": ["mesh.data=8"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=8"],
    "fsdp=4,tensor=2": ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"],
    "fsdp=2,sequence=4 (all-gather)": ["mesh.data=1", "mesh.fsdp=2", "mesh.sequence=4", "model.attention=ring_allgather"],
    "fsdp=2,sequence=4 (ring)": ["mesh.data=1", "mesh.fsdp=2", "mesh.sequence=4", "model.attention=ring"],
    "fsdp=2,sequence=4 (ring, contiguous)": ["mesh.data=1", "mesh.fsdp=2", "mesh.sequence=4", "model.attention=ring",
                                             "model.ring_layout=contiguous"],
    "pipeline=4,data=2 (M=8)": ["mesh.pipeline=4", "mesh.data=2", "train.microbatches=8"],
    "pipeline=2,fsdp=2,tensor=2 (M=4,R=2)": ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
                                             "train.microbatches=4", "train.pipeline_repeats=2",
                                             "train.pipeline_schedule=interleaved"],
    "moe fsdp=2,tensor=2,expert=2": ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2",
                                     "model.moe={num_experts: 4, top_k: 2}"],
}


def ring_bytes_needed(cfg, sizes) -> int:
    """Collective-permute bytes per device and step the ring needs (no remat): per layer, n-1 hops of
    the K and V blocks forward; backward n-1 hops of K, V, dK, dV and the accumulators' last hop."""
    m, t, n = cfg.model, cfg.train, sizes["sequence"]
    rows = t.batch_size // (sizes["data"] * sizes["pipeline"] * sizes["fsdp"] * sizes["expert"])
    block = rows * (t.seq_len // n) * (m.n_kv_heads // sizes["tensor"]) * m.head_dim * 4  # float32
    return m.n_layers * ((n - 1) * 2 * block + (n - 1) * 4 * block + 2 * block)


def measure(overrides, steps=3):
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml"), MODEL + overrides)
    setup = make_setup(cfg)
    source = make_source(cfg)
    with use_mesh(setup.mesh):
        state = init_state(setup, 0)
        compiled, compile_s = compile_train_step(setup)
        times = []
        for i in range(steps + 1):
            batch = put_batch(source.batch(i), setup.batch_sharding)
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
    coll = collective_stats(compiled.as_text())
    extra = {k: float(metrics[k]) for k in ("moe_imbalance", "moe_dropped_frac") if k in metrics}
    if cfg.model.attention == "ring":
        need = ring_bytes_needed(cfg, dict(setup.mesh.shape))
        extra = {**extra, "ring_bytes_needed": need, "ring_bytes_ratio": coll["collective-permute"]["bytes"] / need}
    if cfg.mesh.pipeline > 1:
        extra = {**extra, "pipeline_bubble": schedules.make_table(cfg.train.pipeline_schedule, cfg.mesh.pipeline,
                                                         pipeline_microbatches(cfg), cfg.train.pipeline_repeats).bubble()}
    memory = memory_breakdown(compiled)
    return {**extra, "memory_per_device_bytes": memory["total"], "temporaries_bytes": memory["temporaries"],
            "collective_bytes": sum(c["bytes"] for c in coll.values()),
            "collectives": {k: v for k, v in coll.items() if v["count"]},
            "step_time_s": statistics.median(times[1:]), "compile_s": compile_s}


# Pipeline schedules on 4 stages and 16 microbatches (the S=4, M=16), each at a microbatch of
# one and of two sequences: what grows with the microbatch is the activations the schedule keeps.
SCHEDULE_MESH = ["mesh.pipeline=4", "mesh.data=2", "train.microbatches=16"]
SCHEDULE_ROWS = {"gpipe": [], "1f1b": [], "zero_bubble": [],
                 "interleaved": ["model.n_layers=8", "train.pipeline_repeats=2"],
                 # sequence-parallel stages (ring attention): aligned tables, against gpipe on that mesh
                 "gpipe, sequence=2": ["mesh.data=1", "mesh.sequence=2", "model.attention=ring"],
                 "1f1b, sequence=2": ["mesh.data=1", "mesh.sequence=2", "model.attention=ring"]}


def schedule_rows(extra) -> list[dict]:
    """Per schedule: temporaries per device, their activation part (the growth from 32 to 64
    sequences per step, so 1 to 2 per microbatch per data shard), collective-permute bytes and
    step time, beside the table's bubble and activation peak."""
    rows = []
    for name, more in SCHEDULE_ROWS.items():
        schedule = name.split(",")[0]
        over = SCHEDULE_MESH + more + [f"train.pipeline_schedule={schedule}"] + extra
        batches = (16, 32) if "mesh.data=1" in more else (32, 64)  # one and two sequences per microbatch
        small, large = (measure(over + [f"train.batch_size={b}"], steps=2) for b in batches)
        table = schedules.make_table(schedule, 4, 16, 2 if "train.pipeline_repeats=2" in more else 1,
                                     aligned=schedule != "gpipe" and "mesh.sequence=2" in more)
        rows.append({"schedule": name + (" (aligned)" if table.aligned else ""), "temporaries_bytes": small["temporaries_bytes"],
                     "activation_bytes": large["temporaries_bytes"] - small["temporaries_bytes"],
                     "collective_permute_bytes": small["collectives"].get("collective-permute", {}).get("bytes", 0),
                     "step_time_s": small["step_time_s"], "bubble": table.bubble(),
                     "peak_activations": max(table.peak_activations())})
    base = {"data": rows[0]["activation_bytes"], "sequence": rows[4]["activation_bytes"]}
    print(f"{'schedule (S=4, M=16)':<30} {'temp MiB':>9} {'activations MiB':>16} {'vs gpipe':>9} {'permute MiB':>12} "
          f"{'step ms':>8} {'bubble':>7} {'peak':>5}")
    for r in rows:
        r["activation_ratio"] = r["activation_bytes"] / base["sequence" if "sequence" in r["schedule"] else "data"]
        print(f"{r['schedule']:<30} {r['temporaries_bytes'] / 2**20:>9.1f} {r['activation_bytes'] / 2**20:>16.2f} "
              f"{r['activation_ratio']:>9.3f} {r['collective_permute_bytes'] / 2**20:>12.2f} "
              f"{r['step_time_s'] * 1e3:>8.0f} {100 * r['bubble']:>6.1f}% {r['peak_activations']:>5}")
    return rows


def main(argv=None) -> int:
    extra = list(argv if argv is not None else sys.argv[1:])
    if "--schedules" in extra:
        extra.remove("--schedules")
        print(json.dumps(schedule_rows(extra)))
        return 0
    rows = []
    print(f"{'strategy':<38} {'MiB/device':>10} {'collective MiB':>15} {'step ms':>8}  collectives (count)")
    for name, mesh in STRATEGIES.items():
        r = {"strategy": name, **measure(mesh + extra)}
        rows.append(r)
        kinds = ", ".join(f"{k} {v['count']}" for k, v in r["collectives"].items())
        if "ring_bytes_ratio" in r:
            kinds += f" | ring sends {r['ring_bytes_ratio']:.3f}x what it needs"
        if "pipeline_bubble" in r:
            kinds += f" | bubble {100 * r['pipeline_bubble']:.1f}%"
        if "moe_imbalance" in r:
            kinds += f" | natural routing: max/mean expert load {r['moe_imbalance']:.2f}"
        print(f"{name:<38} {r['memory_per_device_bytes'] / 2**20:>10.1f} {r['collective_bytes'] / 2**20:>15.2f} "
              f"{r['step_time_s'] * 1e3:>8.0f}  {kinds}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
