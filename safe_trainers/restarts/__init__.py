"""A run that outlives its processes: crash restarts, preemption and hangs (cluster concerns, not the NaN guard). It
imports nothing from the guard: where the two meet they name a protocol of `runtime/ports.py`, and the integration
layer (`trainer/`) hands each the other's object.

One module per decision or action:

* `resume_plan`: where `train()` starts (from scratch, the checkpoint it was given, or the newest healthy one), and
  the `resume` event;
* `checkpoint_choice`: which checkpoint is the newest complete and finite one, and why each newer one was passed over;
* `completeness`, `pickled_state`: whether every file of a checkpoint was written to the end, and runs nothing;
* `publishing`: a checkpoint published by renames that leave a complete copy at every point of a crash;
* `agents`: which launch and which of the script's `train()` calls a process is;
* `progress`: the step record kept on disk across restarts, and the poisoned-step decision; `step_progress`
  keeps it and drops a poisoned step's batches;
* `output_lock`: one run per `output_dir`: the lock `train()` holds, and who publishes on shared storage;
* `rotation`: the `save_total_limit` rotation that keeps a run's own newest checkpoint;
* `preemption`, `watchdog`, `hang_report`, `compile_watch`, `compile_peers`: a preemption signal becomes a checkpoint
  and exit 75 (the request rides on the guard's all-reduce as a `FlagRider`), a hung step its stacks and exit 124
  where the elastic agent restarts the process (the watchdog is the guard's `StepClock`); compilation is not a hang.

Crash restarts and the healthy resume run with `nan_guard=False` too; preemption and the watchdog are attached with
the guard.
"""
