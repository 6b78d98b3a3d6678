"""A callback of your own in maxtrain's loop: the global parameter norm every N steps, written to
RUN_DIR/param_norm.csv beside metrics.jsonl.

    python examples/callbacks.py [KEY=VALUE ...]      # trains configs/tiny.yaml with it

A callback is an object with any of `on_start(run)`, `before_step(run, step)`,
`before_dispatch(run, step, state, batch)`, `after_step(run, info)`, `on_end(run, info)` and
`close(run, failed)` (see maxtrain/run/context.py). `info` is an immutable `StepInfo` (step, state,
metrics on device, stopping, final). Callbacks you pass run after the built-in ones, every step:
keep their cadence cheap, and never block on `info.metrics` (it would stall async dispatch).
"""

import os
import sys

import jax
import optax

import maxtrain
from maxtrain.run import Callback


class ParamNorm(Callback):
    def __init__(self, every: int = 10):
        self.every = every
        self.norm = jax.jit(optax.tree.norm)
        self.rows = []

    def on_start(self, run):
        self.path = os.path.join(run.cfg.run_dir, "param_norm.csv")

    def after_step(self, run, info):
        if info.step % self.every == 0 or info.final:
            self.rows.append((info.step, float(self.norm(info.state.params))))  # waits for this step only

    def on_end(self, run, info):
        if run.is_main:
            with open(self.path, "w") as f:
                f.write("step,param_norm\n" + "".join(f"{s},{n:.6g}\n" for s, n in self.rows))


if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = maxtrain.load_config(os.path.join(root, "configs", "tiny.yaml"), sys.argv[1:])
    norms = ParamNorm(every=max(cfg.train.steps // 10, 1))
    maxtrain.train(cfg, callbacks=[norms])
    print(f"param norms: {norms.path}; last {norms.rows[-1][1]:.4f} at step {norms.rows[-1][0]}")
