"""The exit codes of `maxtrain` processes, shared by every launcher (docs/reliability.md)."""

DONE = 0
CRASH = 1  # an uncaught error (traceback in the log): restart from the last good checkpoint
USER_ERROR = 2  # config, data or environment (one `maxtrain: error:` line): stop, it would repeat
PREEMPTED = 75  # EX_TEMPFAIL: stopped by a signal after a final save (or with nothing new to save): requeue
HANG = 76  # the watchdog found no progress (stacks in the log): restart
HALT = 77  # a numerical or integrity guard halted the run: a person should look
UNHEALTHY = 78  # preflight (or the straggler watch) condemned a node (run_dir/preflight.json): requeue without it
