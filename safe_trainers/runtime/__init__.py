"""Shared infrastructure of a run, below the NaN guard (`guard/`) and the machinery that outlives a process
(`restarts/`): it knows no policy and no Trainer.

`checkpoint_dirs` (checkpoint names, the staging directory), `events` (the run's event log), `collectives` (the few
cross-rank reductions), `finite` (the bounded finiteness check), `nested` (the one walker of nested tensors),
`sharding` (FSDP2's DTensors), `host_buffers` (exact host copies), `files` (writes that never follow a link),
`guard_state_file` (the format of `nan_guard_state.json`), `ports` (the protocols through which the guard and the
restarts meet: a step clock, a flag riding on the guard's all-reduce).
"""
