"""Mutants for multi-process placement and ownership (area `own`): the local tier's ring, the
checkpoint directory lock's takeover rules, and which config keys make a run directory another run."""

LC = "maxtrain/checkpoint/local.py"
CK = "maxtrain/checkpoint/lock.py"
RD = "maxtrain/rundir.py"
RING_TESTS = ("tests/test_local_checkpoint.py", "-k", "ring or permute or simulated")
LOCK_TESTS = ("tests/test_checkpoint.py", "-k", "lock_takeover")
RUN_TESTS = ("tests/test_observability.py", "-k", "identify_a_run or section_on_or_off")

MUTANTS = [
    # ---- local tier: which neighbour holds which copy
    M("own_ring_successor_is_predecessor", "own", LC,
      "self.successor_of = {p: order[(n + 1) % P] for n, p in enumerate(order)}",
      "self.successor_of = {p: order[(n - 1) % P] for n, p in enumerate(order)}", RING_TESTS),
    M("own_ring_host_major", "own", LC,
      "return [g[r] for r in range(len(groups[0])) for g in groups]",
      "return [p for g in groups for p in g]", RING_TESTS),
    M("own_ring_uneven_hosts_interleaved", "own", LC,
      "if len(groups) < 2 or len({len(g) for g in groups}) != 1:",
      "if len(groups) < 2 or len({len(g) for g in groups}) > 2:", RING_TESTS),
    M("own_ring_one_host_reversed", "own", LC,
      "        return list(range(len(hosts)))\n    return [g[r]",
      "        return list(range(len(hosts)))[::-1]\n    return [g[r]", RING_TESTS),
    M("own_forward_pairs_reversed", "own", LC,
      "self.forward = [(i, by_process[self.successor_of[p]][k]) for p in order",
      "self.forward = [(by_process[self.successor_of[p]][k], i) for p in order", RING_TESTS),
    M("own_forward_device_rank_shifted", "own", LC,
      "self.forward = [(i, by_process[self.successor_of[p]][k]) for p in order",
      "self.forward = [(i, by_process[self.successor_of[p]][k - 1]) for p in order", RING_TESTS),
    M("own_source_of_inverted", "own", LC,
      "self.source_of = {j: i for i, j in self.forward}",
      "self.source_of = {i: j for i, j in self.forward}", RING_TESTS),
    M("own_predecessor_is_successor", "own", LC,
      "self.predecessor = next(p for p, q in self.successor_of.items() if q == me)",
      "self.predecessor = self.successor_of[me]", RING_TESTS),
    M("own_save_peer_named_after_successor", "own", LC,
      "        blocked = time.perf_counter() - t0\n        me, pred = jax.process_index(), self.ring.predecessor",
      "        blocked = time.perf_counter() - t0\n        me, pred = jax.process_index(), self.ring.successor",
      RING_TESTS),
    M("own_candidates_copy_at_predecessor", "own", LC,
      "return [s for s in steps if all(s in owns[p] or (self.peers and s in peers[succ[p]]) for p in succ)]",
      "return [s for s in steps if all(s in owns[p] or (self.peers and s in peers[[q for q in succ if succ[q] == p][0]]) "
      "for p in succ)]", RING_TESTS),
    M("own_candidates_any_copy_of_anyone", "own", LC,
      "return [s for s in steps if all(s in owns[p] or (self.peers and s in peers[succ[p]]) for p in succ)]",
      "return [s for s in steps if all(s in owns[p] or (self.peers and s in peers) for p in succ)]", RING_TESTS),
    M("own_restore_whole_at_predecessor", "own", LC,
      "whole = all(flags[p, 0] or (self.peers and flags[succ[p], 1]) for p in succ)",
      "whole = all(flags[p, 0] or (self.peers and flags[[q for q in succ if succ[q] == p][0], 1]) for p in succ)",
      RING_TESTS),
    M("own_restore_reads_successors_name", "own", LC,
      "        names, leaves, treedef = _flat(abstract)\n        me, pred = jax.process_index(), self.ring.predecessor",
      "        names, leaves, treedef = _flat(abstract)\n        me, pred = jax.process_index(), self.ring.successor",
      RING_TESTS),
    M("own_received_labelled_by_own_device", "own", LC,
      "        source = ring.flat[ring.source_of[_device_index(ring, s.device)]]\n        k = _key",
      "        source = s.device\n        k = _key", RING_TESTS),
    # ---- the checkpoint directory lock's takeover rules
    M("own_lock_same_pid_on_any_host_is_me", "own", CK,
      'if here and holder.get("pid") == self.record["pid"]:',
      'if holder.get("pid") == self.record["pid"]:', LOCK_TESTS),
    M("own_lock_recycled_pid_alive_refused", "own", CK,
      'if locked or not _pid_alive(holder.get("pid")):',
      'if not _pid_alive(holder.get("pid")):', LOCK_TESTS),
    M("own_lock_pid_alive_means_gone", "own", CK,
      'if locked or not _pid_alive(holder.get("pid")):',
      'if locked or _pid_alive(holder.get("pid")):', LOCK_TESTS),
    M("own_lock_stale_inverted", "own", CK,
      'return f"its heartbeat is {age:.0f}s old" if age > LOCK_STALE_S else None',
      'return f"its heartbeat is {age:.0f}s old" if age < LOCK_STALE_S else None', LOCK_TESTS),
    M("own_lock_stale_in_minutes", "own", CK,
      "age = time.time() - os.stat(self.path).st_mtime\n        return f\"its heartbeat",
      "age = (time.time() - os.stat(self.path).st_mtime) / 60\n        return f\"its heartbeat", LOCK_TESTS),
    M("own_lock_no_job_matches_no_job", "own", CK,
      'if holder.get("job") and holder.get("job") == self.record["job"]:',
      'if holder.get("job") == self.record["job"]:', LOCK_TESTS),
    M("own_lock_job_before_flock", "own", CK,
      "        if locked is False:  # its flock is held: alive, whatever its record says\n            return None\n"
      "        if holder.get(\"job\") and holder.get(\"job\") == self.record[\"job\"]:\n"
      "            return \"an earlier attempt of this job\"\n",
      "        if holder.get(\"job\") and holder.get(\"job\") == self.record[\"job\"]:\n"
      "            return \"an earlier attempt of this job\"\n"
      "        if locked is False:  # its flock is held: alive, whatever its record says\n            return None\n",
      LOCK_TESTS),
    M("own_lock_free_flock_anywhere_takes_over", "own", CK,
      "        if here:\n            if locked or not _pid_alive",
      "        if here or locked:\n            if locked or not _pid_alive", LOCK_TESTS),
    M("own_lock_same_process_checked_after_flock", "own", CK,
      "        here = holder.get(\"host\") == self.record[\"host\"]\n"
      "        if here and holder.get(\"pid\") == self.record[\"pid\"]:\n"
      "            return \"this process, which never released it\"\n"
      "        if locked is False:  # its flock is held: alive, whatever its record says\n            return None\n",
      "        here = holder.get(\"host\") == self.record[\"host\"]\n"
      "        if locked is False:  # its flock is held: alive, whatever its record says\n            return None\n"
      "        if here and holder.get(\"pid\") == self.record[\"pid\"]:\n"
      "            return \"this process, which never released it\"\n", LOCK_TESTS),
    M("own_lock_unreadable_is_nobody", "own", CK,
      'return {"host": "?", "pid": None} if data.strip() else None  # unreadable',
      'return None  # unreadable', LOCK_TESTS),
    # ---- which keys make a run directory another run
    M("own_rundir_remat_identifies", "own", RD,
      'HOW_COMPUTED = ("model.attention", "model.ring_layout", "model.remat", "model.fused_norm")',
      'HOW_COMPUTED = ("model.attention", "model.ring_layout", "model.fused_norm")', RUN_TESTS),
    M("own_rundir_norm_eps_exempt", "own", RD,
      'HOW_COMPUTED = ("model.attention", "model.ring_layout", "model.remat", "model.fused_norm")',
      'HOW_COMPUTED = ("model.attention", "model.ring_layout", "model.remat", "model.fused_norm", "model.norm_eps")',
      RUN_TESTS),
    M("own_rundir_section_prefix_exempt", "own", RD,
      "return {k: v for k, v in out.items() if k not in HOW_COMPUTED}",
      "return {k: v for k, v in out.items() if not any(k.startswith(h) for h in HOW_COMPUTED + ('model.m',))}",
      RUN_TESTS),
    M("own_rundir_seed_not_identity", "own", RD,
      'IDENTITY_SECTIONS = ("model", "seed")', 'IDENTITY_SECTIONS = ("model",)', RUN_TESTS),
    M("own_rundir_optim_identifies", "own", RD,
      'IDENTITY_SECTIONS = ("model", "seed")', 'IDENTITY_SECTIONS = ("model", "seed", "optim")', RUN_TESTS),
    M("own_rundir_new_keys_ignored", "own", RD,
      "keys = sorted(set(old) | set(new))", "keys = sorted(set(old))", RUN_TESTS),
    M("own_rundir_nested_compared_by_first_key", "own", RD,
      "            for k, v in value.items():\n                walk(",
      "            for k, v in list(value.items())[:1] if prefix.count('.') else value.items():\n                walk(",
      RUN_TESTS),
]

MUTANTS += [
    M("own_lock_release_removes_a_successors_lock", "own", CK,
      'if holder and holder.get("token") == self.record["token"] and _same_file(self._fd, self.path):',
      'if holder and _same_file(self._fd, self.path):',
      ("tests/test_checkpoint.py", "-k", "releases_only")),
    M("own_local_retention_drops_newest", "own", LC,
      "for s in steps[:-self.cfg.keep] if self.cfg.keep > 0 else []:",
      "for s in steps[self.cfg.keep:] if self.cfg.keep > 0 else []:", RING_TESTS),
]
