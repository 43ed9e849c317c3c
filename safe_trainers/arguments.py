"""`SafetyArguments`: the fields `safe_trainers` adds to every TRL trainer config.

They are mixed into `RewardConfig`, `DPOConfig`, `KTOConfig` and `GRPOConfig` (see `configs.py`), so they are set like
any other config field, in Python, in a YAML `--config` file, or as CLI flags through TRL's parser. A plain TRL config
has none of these fields; `SafetyArguments.from_config` then returns the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from .collapse.signals import DEFAULT_SIGNALS, SIGNAL_NAMES
from .argument_checks import HANG_ACTIONS, ROLLBACK_SOURCES, SAFETY_MODES, validate_safety_arguments


SafetyMode = Literal["fix", "warn", "strict", "off"]


@dataclass
class SafetyArguments:
    r"""
    Fields shared by every `safe_trainers` config.

    > Parameters that control the safety rules

    safety_mode (`str`, *optional*, defaults to `"fix"`):
        `"fix"` applies each rule's fix and reports it; `"warn"` reports and changes nothing; `"strict"` raises one
        [`SafetyError`] listing every finding; `"off"` runs no rule. Findings that would make training fail or produce
        NaN (`blocked`) raise in every mode but `"off"`.
    safety_disable_rules (`list[str]`, *optional*, defaults to `[]`):
        Rule ids to skip, e.g. `["precision.bf16_over_fp16"]`. An unknown id is an error that lists the valid ids.

    > Parameters that control the NaN guard

    nan_guard (`bool`, *optional*, defaults to `True`):
        Check every optimizer step for a non-finite loss or gradient norm, skip such updates on all ranks, and roll
        back to the last good state when the weights or optimizer state are damaged.
    nan_snapshot_steps (`int`, *optional*, defaults to `None`):
        Keep a copy of the last good training state (in host memory) at least this many optimizer steps apart (the
        lower bound of the adaptive interval, see `nan_snapshot_budget`; with `nan_snapshot_budget=0`, exactly this
        many). Unset: start at 10 steps, no lower bound beyond 1. The pending fault flags are read back every this
        many steps (10 when unset) whatever the interval.
    nan_snapshot_budget (`float`, *optional*, defaults to `0.01`):
        The fraction of the run's wall time the snapshots (a state check and a copy of the state) may take: the
        interval between them adapts to it (aiming at half of it, a margin for the error of the measured figures),
        measured at run time, from `nan_snapshot_steps` up to the checkpoint interval (`save_steps`). A rollback goes
        back at most that interval. `0` keeps a fixed interval.
    nan_rollback_from (`str`, *optional*, defaults to `"memory"`):
        Where a rollback takes the last good state from: `"memory"` (the host copy above) or `"checkpoint"` (the
        newest verified checkpoint on disk: no host copy, a slower restore, and the steps since that checkpoint are
        discarded). The `memory.snapshot_fits` rule switches to `"checkpoint"` when the copy would not fit in the
        host memory available.
    nan_max_rollbacks (`int`, *optional*, defaults to `3`):
        After this many rollbacks, save the last good state as a checkpoint and raise [`TrainingDivergedError`].
    nan_max_consecutive_skips (`int`, *optional*, defaults to `3`):
        This many skipped steps in a row trigger a rollback.
    nan_lr_backoff (`float`, *optional*, defaults to `0.5`):
        Multiply the learning rate by this factor at each rollback (`1.0` keeps it).
    nan_spike_factor (`float`, *optional*, defaults to `0.0`):
        Spike threshold in standard deviations: a step whose loss or (pre-clip) gradient norm lies more than
        `nan_spike_factor` standard deviations above its mean over the last `nan_spike_window` applied steps (a
        one-sided z-score, valid for losses of any sign and scale) is spiking, and its update is skipped on the
        device, on every rank alike, like a non-finite step (`nan_max_consecutive_skips` skips in a row roll back).
        `0` disables spike detection.
    nan_spike_window (`int`, *optional*, defaults to `64`):
        How many recent applied steps the spike detector's mean and standard deviation cover. The window is saved
        with every checkpoint, so a resumed run judges its first steps against its own history.
    nan_spike_warmup (`int`, *optional*, defaults to `16`):
        Applied steps the spike detector observes before it judges any step (at most `nan_spike_window`).
    nan_spike_patience (`int`, *optional*, defaults to `None`):
        Deprecated and unused: a spiking step is now skipped at once, before its update, and a run of skipped steps
        rolls back after `nan_max_consecutive_skips`. Setting it warns.
    nan_replay_max_bytes (`int`, *optional*, defaults to `67108864` (64 MiB)):
        On a `skip`, `rollback` or `poison` event, the step's micro-batches (GRPO/RLOO: with the rewards), the state
        entries found non-finite and the test faults that fired go to `output_dir/nan_replay/step-N/`, for
        `safe-trainers replay` (docs/replay.md). Each process's file of a bundle holds at most this many bytes of
        tensors (what does not fit is left out and listed in its `meta.json`). `0` writes no bundle.
    nan_replay_limit (`int`, *optional*, defaults to `5`):
        How many replay bundles are kept: the oldest steps' are deleted first, as `save_total_limit` does.

    > Parameters that control crashes and restarts

    resume_on_restart (`bool`, *optional*, defaults to `True`):
        When torchrun's elastic agent restarts the process (`torchrun --max-restarts N`, `accelerate launch
        --max_restarts N`), `train()` resumes from the newest complete and finite checkpoint of `output_dir`, as
        `resume_from_checkpoint=True` does, instead of starting over at step 0.
    skip_step_after_crashes (`int`, *optional*, defaults to `2`):
        With `nan_guard=True`: a step whose batches killed the process this many times in a row (SIGKILL, segfault,
        device-side assert, ...) is not fed again; its batches are skipped and training goes on. `0` disables.
    trusted_checkpoint_globals (`list[str]`, *optional*, defaults to `[]`):
        Globals (dotted `module.Name`) a checkpoint's DeepSpeed or DCP state may hold beyond the classes those
        backends store. Both load that state with pickle's full unpickler, so a resume passes over a checkpoint that
        needs any other (`resume_from_checkpoint=True`, a restart) or refuses it (an explicit path): name here the
        ones of a checkpoint you wrote yourself and trust.
    job_end_time (`float`, *optional*, defaults to `None`):
        When the job ends, as a Unix time: the run publishes a verified checkpoint and exits with status 75
        (resumable) early enough to be done before it (the longest step, the measured save time and
        `job_end_slack`). Unset: SLURM's `SLURM_JOB_END_TIME`, when the job runs under SLURM with a time limit;
        `0`: no deadline, whatever the scheduler says. Needs `nan_guard`.
    job_end_slack (`float`, *optional*, defaults to `60.0`):
        Seconds kept free before `job_end_time` beyond the longest step and the save time.
    save_in_background (`bool`, *optional*, defaults to `True`):
        With `nan_guard`, a checkpoint blocks training only while the state is copied to host memory; a background
        thread writes, checks and publishes it, and `on_save`, uploads, rotation and the step record see it then.
        `False` writes every checkpoint before training goes on. DeepSpeed and FSDP save synchronously.

    > Parameters that control the collapse watch (GRPO and RLOO)

    collapse_signals (`list[str]`, *optional*, defaults to `["entropy", "kl", "completion_length"]`):
        With `nan_guard`, the metrics TRL computes that are judged at every step against the run's own recent steps:
        one warn-only `collapse` event per episode (`docs/collapse.md`). Also, off by default, `"reward_std"` and
        `"frac_reward_zero_std"` (false alarms with a sparse 0/1 reward) and `"reward"`. `[]` disables.
    collapse_window (`int`, *optional*, defaults to `32`):
        Recent steps each signal's level (median) and scale (median absolute deviation) cover; judged from half.
    collapse_patience (`int`, *optional*, defaults to `3`):
        Least steps in a row past a signal's threshold that make an episode (and back within it that end one).

    > Parameters that control where the events are reported

    event_alert_interval (`float`, *optional*, defaults to `600.0`):
        With `report_to` naming `"wandb"`: the least seconds between two W&B alerts (`run.alert`) of one event kind;
        the events held back are counted in the next one. `0`: one alert per event (docs/observability.md).
    """

    safety_mode: SafetyMode = field(
        default="fix",
        metadata={
            "help": "How the safety rules act: `fix` applies fixes and reports them, `warn` only reports, `strict` "
            "raises one SafetyError listing every finding, `off` runs no rule.",
            "choices": list(SAFETY_MODES),
        },
    )
    safety_disable_rules: list[str] = field(
        default_factory=list,
        metadata={"help": "Rule ids to skip, e.g. `precision.bf16_over_fp16`. Run `safe-trainers rules` for the list."},
    )
    nan_guard: bool = field(
        default=True,
        metadata={"help": "Skip non-finite updates and roll back to the last good state when training is damaged."},
    )
    nan_snapshot_steps: int | None = field(
        default=None,
        metadata={
            "help": "Keep the last good training state in host memory at least this many optimizer steps apart "
            "(exactly, with `nan_snapshot_budget=0`); unset: start at 10, adapt from 1."
        },
    )
    nan_snapshot_budget: float = field(
        default=0.01,
        metadata={
            "help": "Fraction of the wall time the snapshots may take: their interval adapts to it (aiming at half "
            "of it), between `nan_snapshot_steps` and `save_steps` (0: a fixed interval)."
        },
    )
    nan_rollback_from: str = field(
        default="memory",
        metadata={
            "help": "Where a rollback takes the last good state from: `memory` (a host copy taken every "
            "`nan_snapshot_steps`) or `checkpoint` (the newest verified checkpoint on disk: no host memory, a slower "
            "restore).",
            "choices": list(ROLLBACK_SOURCES),
        },
    )
    nan_max_rollbacks: int = field(
        default=3,
        metadata={"help": "Rollbacks allowed before saving the last good state and stopping with an error."},
    )
    nan_max_consecutive_skips: int = field(
        default=3, metadata={"help": "This many skipped steps in a row trigger a rollback."}
    )
    nan_lr_backoff: float = field(
        default=0.5, metadata={"help": "Multiply the learning rate by this factor at each rollback (1.0 keeps it)."}
    )
    nan_spike_factor: float = field(
        default=0.0,
        metadata={
            "help": "Skip, on the device, a step whose loss or pre-clip grad norm lies more than this many standard "
            "deviations above its mean over the last `nan_spike_window` applied steps (0 disables)."
        },
    )
    nan_spike_window: int = field(
        default=64, metadata={"help": "Applied steps the spike detector's mean and standard deviation cover."}
    )
    nan_spike_warmup: int = field(
        default=16,
        metadata={"help": "Applied steps the spike detector observes before judging any (<= `nan_spike_window`)."},
    )
    nan_spike_patience: int | None = field(
        default=None,
        metadata={"help": "Deprecated and unused: a spiking step is skipped at once (setting it warns)."},
    )
    nan_replay_max_bytes: int = field(
        default=64 * 2**20,
        metadata={
            "help": "Bytes of tensors each process writes to a step's replay bundle (`output_dir/nan_replay/step-N/`) "
            "on a skip, rollback or poison event; what does not fit is listed in its meta.json (0: no bundles)."
        },
    )
    nan_replay_limit: int = field(
        default=5, metadata={"help": "Replay bundles kept; the oldest steps' are deleted first."}
    )
    resume_on_restart: bool = field(
        default=True,
        metadata={
            "help": "When torchrun's elastic agent restarts the process, resume from the newest complete and finite "
            "checkpoint of `output_dir` instead of starting over."
        },
    )
    skip_step_after_crashes: int = field(
        default=2,
        metadata={
            "help": "Skip the batches of a step that killed the process this many times in a row (0 disables; needs "
            "`nan_guard`)."
        },
    )
    trusted_checkpoint_globals: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Globals (`module.Name`) a checkpoint's DeepSpeed or DCP state may hold beyond those the backends "
            "store; a resume otherwise passes over (or, for an explicit path, refuses) a checkpoint that needs one."
        },
    )

    save_in_background: bool = field(
        default=True,
        metadata={
            "help": "Write each checkpoint in a background thread after copying the state to host memory (training "
            "goes on; `on_save` and uploads see it once published). `False`: write it before training goes on."
        },
    )
    preempt_signals: list[str] = field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"],
        metadata={
            "help": "Signals that mean preempted: finish the step on every rank, publish a verified checkpoint, exit "
            "with status 75 ([] leaves signals alone; needs `nan_guard`)."
        },
    )
    hang_timeout: float = field(
        default=900.0,
        metadata={
            "help": "Ceiling, in seconds, on a step's time (compilation not counted) before the run is taken for "
            "hung (stacks written, see `hang_action`); the bound learned from the steps is lower (0 disables)."
        },
    )
    hang_timeout_factor: float = field(
        default=10.0, metadata={"help": "The learned hang bound in multiples of the slowest step timed so far."}
    )
    hang_action: str = field(
        default="auto",
        metadata={
            "help": "What a hang does after its stacks are written: `\"exit\"` ends the process with status 124 (for "
            "a restart), `\"report\"` logs it and goes on, `\"auto\"` exits only under torchrun's elastic agent "
            "with restarts left to give (`--max-restarts` above the restarts so far).",
            "choices": list(HANG_ACTIONS),
        },
    )
    job_end_time: float | None = field(
        default=None,
        metadata={
            "help": "The job's end as a Unix time: publish a checkpoint and exit 75 in time (unset: SLURM's "
            "`SLURM_JOB_END_TIME` if any; 0: no deadline; needs `nan_guard`)."
        },
    )
    job_end_slack: float = field(
        default=60.0, metadata={"help": "Seconds kept free before the job's end beyond a step and a save."}
    )
    event_alert_interval: float = field(
        default=600.0, metadata={"help": "Least seconds between two W&B alerts of one event kind (0: one per event)."}
    )
    collapse_signals: list[str] = field(
        default_factory=lambda: list(DEFAULT_SIGNALS),
        metadata={
            "help": "GRPO/RLOO metrics judged each step against the run's recent steps for a collapse without a NaN "
            f"(warn-only `collapse` events; needs `nan_guard`; [] disables). Any of {list(SIGNAL_NAMES)}."
        },
    )
    collapse_window: int = field(
        default=32, metadata={"help": "Recent steps each collapse signal's level and scale cover (judged from half)."}
    )
    collapse_patience: int = field(
        default=3, metadata={"help": "Steps in a row past a collapse threshold that make (and end) an episode."}
    )

    def __post_init__(self):
        validate_safety_arguments(self)
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()

    @classmethod
    def from_config(cls, config: Any) -> "SafetyArguments":
        """Read the safety fields from any config object; missing fields (a plain TRL config) take the defaults."""
        values = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}
        settings = object.__new__(cls)
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default
            setattr(settings, f.name, values.get(f.name, default))
        validate_safety_arguments(settings)
        return settings
