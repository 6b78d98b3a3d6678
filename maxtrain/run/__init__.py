"""A training run: the loop over ordered callbacks and the parts that own a run (resume, the run
directory, the saves, the guard's host side, checks, records). `maxtrain.step` holds the pure
step these parts drive.

    maxtrain.run.train(cfg, callbacks=[...])   # also maxtrain.train
    class MyCallback(maxtrain.run.Callback): ...
"""

from maxtrain.run.context import Callback, Run, StepInfo  # noqa: F401
from maxtrain.run.loop import TrainResult, default_callbacks, train  # noqa: F401

__all__ = ["train", "Callback", "Run", "StepInfo", "TrainResult", "default_callbacks"]
