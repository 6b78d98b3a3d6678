"""Surviving long runs, one small module per concern:

- `guards`: numerical guards in the step (skip, halt, rollback, consecutive skips);
- `watchdog`: the hang watchdog (stacks, exit 76), start-up and restore phases;
- `integrity`: replica fingerprints (silent corruption) and the deterministic replay check;
- `stragglers`: slow processes named by their host step work;
- `goodput`: where each attempt's wall time went;
- `cache`: the persistent compilation cache;
- `drills`: faults injected on purpose (config section `drills:`).

Exit codes: `maxtrain/exit_codes.py` (and docs/reliability.md).
"""

from maxtrain.exit_codes import HALT as HALT_EXIT_CODE, HANG as HANG_EXIT_CODE  # noqa: F401
from maxtrain.reliability.cache import enable_compilation_cache  # noqa: F401
from maxtrain.reliability.goodput import Goodput  # noqa: F401
from maxtrain.reliability.guards import (EVENT_KINDS, Halted, check_step, guards_on, init_guard,  # noqa: F401
                                         report_events)
from maxtrain.reliability.integrity import (Corrupted, Nondeterministic, check_replay, check_replicas,  # noqa: F401
                                            make_fingerprint, mismatched_devices, replica_axes)
from maxtrain.reliability.stragglers import StragglerWatch, slow_processes  # noqa: F401
from maxtrain.reliability.watchdog import Watchdog, dump_stacks  # noqa: F401
