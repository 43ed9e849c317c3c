"""A run that outlives its processes: crash restarts, preemption and hangs (cluster concerns, not the NaN guard).

One module per decision or action:

* `resume_plan`: where `train()` starts (from scratch, the checkpoint it was given, or the newest healthy one), and
  the `resume` event;
* `checkpoint_choice`: which checkpoint is the newest complete and finite one, and why each newer one was passed over;
* `completeness`: whether every file of a checkpoint was written to the end;
* `launch`: which launch and which of the script's `train()` calls a process is;
* `step_record`: the step record kept on disk across restarts, and the poisoned-step decision;
* `record_callback`: the callback that keeps the step record and drops a poisoned step's batches;
* `output_lock`: one run per `output_dir`: the lock `train()` holds, and who publishes on shared storage;
* `rotation`: the `save_total_limit` rotation that keeps a run's own newest checkpoint;
* `preemption`, `watchdog`, `hang_report`, `compile_watch`, `run_control`: a preemption signal becomes a checkpoint
  and exit 75, a hung step its stacks and exit 124 where the elastic agent restarts the process (a report elsewhere);
  compilation is not a hang; `run_control` wires them into a guarded trainer.

Crash restarts and the healthy resume run with `nan_guard=False` too; preemption and the watchdog ride on the guard's
per-step all-reduce and verified saves, so they are attached with the guard.
"""
