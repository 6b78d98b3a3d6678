"""Pipeline bookkeeping mutants (AREA = pipe): schedule tables and the executors' per-visit statistics.

`M` is tests/mutate.py's Mutant (injected by its loader)."""

SCH = "maxtrain/parallel/schedules.py"
PIPE = "maxtrain/parallel/pipeline.py"
TABLES = ("tests/test_schedules.py", "-k", "documented_rule or hand_derived or groups_of or documented_lengths")
GPIPE_STATS = ("tests/test_schedules.py", "-k", "gpipe_layers_with or stage_specs_put")
EXEC_STATS = ("tests/test_schedules.py", "-k", "executed_schedule and (interleaved-4 or gpipe)")

MUTANTS = [
    # aligned tables: which kind runs among equally many ready stages, and the cap
    M("pipe_aligned_forward_before_backward", "pipe", SCH, '_PRIORITY = {"B": 0, "F": 1, "W": 2}',
      '_PRIORITY = {"B": 1, "F": 0, "W": 2}', TABLES),
    M("pipe_aligned_weights_before_forward", "pipe", SCH, '_PRIORITY = {"B": 0, "F": 1, "W": 2}',
      '_PRIORITY = {"B": 0, "F": 2, "W": 1}', TABLES),
    M("pipe_aligned_first_kind_not_most_ready", "pipe", SCH, "key=lambda k: (-len(ready[k]), _PRIORITY[k])",
      "key=lambda k: (not ready[k], _PRIORITY[k])", TABLES),
    M("pipe_aligned_cap_not_less_one", "pipe", SCH, "repeats, 2 * peak - 1,", "repeats, 2 * peak,", TABLES),
    M("pipe_aligned_cap_inclusive", "pipe", SCH, "if fwd[s] and alive[s] < cap and", "if fwd[s] and alive[s] <= cap and",
      TABLES),
    # programs: interleaved chunk order, warm-ups, gpipe's backward order
    M("pipe_gpipe_repeats_microbatch_major", "pipe", SCH, "return [(m, r * S + s) for r in range(R) for m in range(M)]",
      "return [(m, r * S + s) for m in range(M) for r in range(R)]", TABLES),
    M("pipe_interleaved_chunk_off_by_one", "pipe", SCH,
      "return [(m, r * S + s) for g in range(M // S) for r in chunks for m in range(g * S, (g + 1) * S)]",
      "return [(m, r * S + s) for g in range(M // S) for r in chunks for m in range(g * S, (g + 1) * S)] "
      "if backward else [(m, r * S + s) for g in range(M // S) for m in range(g * S, (g + 1) * S) for r in chunks]",
      TABLES),
    M("pipe_interleaved_warmup_short", "pipe", SCH, "2 * (S - s - 1) + (R - 1) * S, split=False)",
      "2 * (S - s - 1) + (R - 1) * S - 1, split=False)", TABLES),
    M("pipe_1f1b_warmup_long", "pipe", SCH, "_items(S, M, 1, s), S - s - 1, split=",
      "_items(S, M, 1, s), S - s, split=", TABLES),
    M("pipe_gpipe_backward_in_forward_order", "pipe", SCH,
      'back = [op for m, v in reversed(items) for op in (Op("B", m, v), Op("W", m, v))]',
      'back = [op for m, v in items for op in (Op("B", m, v), Op("W", m, v))]', TABLES),
    # dependencies (validate shares `_deps`, so it cannot see these) and zero-bubble's deferral
    M("pipe_unsplit_backward_waits_for_b_not_w", "pipe", SCH,
      'later = [] if op.chunk == chunks - 1 else [Op("B" if split else "W", op.microbatch, op.chunk + 1)]',
      'later = [] if op.chunk == chunks - 1 else [Op("B", op.microbatch, op.chunk + 1)]', TABLES),
    M("pipe_zero_bubble_newest_weight_first", "pipe", SCH, "            elif pending[s]:\n                op = pending[s].pop(0)",
      "            elif pending[s]:\n                op = pending[s].pop()", TABLES),
    M("pipe_zero_bubble_cap_plus_one", "pipe", SCH, "defer_weights=True, caps=[cap] * stages)",
      "defer_weights=True, caps=[cap + 1] * stages)", TABLES),
    M("pipe_zero_bubble_cap_ignores_queue", "pipe", SCH,
      'if ready and head.kind == "F" and caps is not None and alive[s] >= caps[s] and pending[s]:',
      'if ready and head.kind == "F" and caps is not None and alive[s] > caps[s] and pending[s]:', TABLES),
    # per-visit statistics and per-chunk attribution with R > 1
    M("pipe_gpipe_stats_over_m_not_m_times_r", "pipe", PIPE, "jax.lax.psum(a, AXIS) / (work * S)",
      "jax.lax.psum(a, AXIS) / (M * S)", GPIPE_STATS),
    M("pipe_gpipe_stats_over_r_not_s", "pipe", PIPE, "jax.lax.psum(a, AXIS) / (work * S)",
      "jax.lax.psum(a, AXIS) / (work * R)", GPIPE_STATS),
    M("pipe_gpipe_stats_count_bubble_visits", "pipe", PIPE, "lambda a, b: a + jnp.where(valid, b, 0.0)",
      "lambda a, b: a + jnp.where(i >= 0, b, 0.0)", GPIPE_STATS),
    M("pipe_gpipe_repeat_of_item", "pipe", PIPE, "m, r = i % M, i // M", "m, r = i % M, (i // M) % (R - 1 or 1)",
      GPIPE_STATS),
    M("pipe_stage_specs_stage_major", "pipe", PIPE, "init=lambda key, _, spec=spec: spec.init(key, spec.shape).reshape(shape))",
      "init=lambda key, _, spec=spec: spec.init(key, spec.shape).reshape((shape[1], shape[0]) + shape[2:]).swapaxes(0, 1))",
      GPIPE_STATS),
    M("pipe_execute_stats_over_s_not_s_times_r", "pipe", PIPE, "mean = None if stats_s is None else jax.tree.map(lambda a: a / (S * R), acc)",
      "mean = None if stats_s is None else jax.tree.map(lambda a: a / S, acc)", EXEC_STATS),
    M("pipe_execute_stats_over_r_squared", "pipe", PIPE, "mean = None if stats_s is None else jax.tree.map(lambda a: a / (S * R), acc)",
      "mean = None if stats_s is None else jax.tree.map(lambda a: a / (R * R), acc)", EXEC_STATS),
    M("pipe_execute_weight_grad_of_next_chunk", "pipe", PIPE,
      "jax.lax.dynamic_update_index_in_dim(a, _at(a, r) + d, r, 0)",
      "jax.lax.dynamic_update_index_in_dim(a, _at(a, (r + 1) % R) + d, (r + 1) % R, 0)", EXEC_STATS),
]
MUTANTS += [
    # the checker and the table's own bookkeeping
    M("pipe_validate_unsplit_backward_checked_as_split", "pipe", SCH,
      "late = [d for d in _deps(op, S * R, split or table.whole_backward) if when[d] >= t]",
      "late = [d for d in _deps(op, S * R, True) if when[d] >= t]", ("tests/test_schedules.py", "-k", "rejects_broken")),
    M("pipe_validate_stage_unchecked", "pipe", SCH, "if op in when or op.chunk % S != s:", "if op in when:",
      ("tests/test_schedules.py", "-k", "rejects_broken")),
    M("pipe_peak_aligned_counts_until_w", "pipe", SCH, 'last = "B" if self.whole_backward else "W"', 'last = "W"',
      TABLES),
    # the scheduled loss's custom VJP scales by its cotangent (the trainer's is 1; the test's 2.5)
    M("pipe_scheduled_vjp_ignores_cotangent", "pipe", PIPE, "return jax.tree.map(lambda d: (g * d).astype(d.dtype), grads)",
      "return jax.tree.map(lambda d: d.astype(d.dtype), grads)", EXEC_STATS),
]
