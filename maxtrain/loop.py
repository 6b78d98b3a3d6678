"""Deprecated: the loop lives in `maxtrain.run` (`from maxtrain.run import Callback, StepInfo, Run,
train`). This module keeps `from maxtrain.loop import Callback` (and the other names it had)
working, with a DeprecationWarning, for code written against earlier versions."""

import warnings

from maxtrain.run import Callback, Run, StepInfo, TrainResult, default_callbacks, train  # noqa: F401
from maxtrain.run.context import (is_checkpoint_step, is_eval_step, is_log_step, is_sample_step,  # noqa: F401
                                  saves_after)

warnings.warn("maxtrain.loop is deprecated: import Callback, StepInfo, Run and train from maxtrain.run",
              DeprecationWarning, stacklevel=2)

train_loop = train
