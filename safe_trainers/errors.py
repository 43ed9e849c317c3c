"""Exceptions raised by `safe_trainers`.

Each keeps the exception type that TRL and transformers raise for the same class of problem, so code that already
catches those keeps working: a configuration problem is a `ValueError`, a failed run is a `RuntimeError`.

The findings a [`SafetyError`] lists are the rules' (`rules/report.py`, which imports from here, never the reverse);
the opt-out wording its message ends with ([`OptOut`]) lives here, and the rules' report reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from .rules.report import Finding


@dataclass(frozen=True)
class OptOut:
    """How a user switches rules off where a refusal ([`SafetyError`]) or a report is read: config fields for the
    trainers, flags for the shim.

    Args:
        setting (`str`): the setting that lists the skipped rules, e.g. "`safety_disable_rules`".
        disable (`str`): how to skip one rule, e.g. "`safety_disable_rules=[<rule id>]`".
        mode (`str`): how to set the mode, with `{mode}` for the value, e.g. '`safety_mode="{mode}"`'.
    """

    setting: str
    disable: str
    mode: str

    def set_mode(self, mode: str) -> str:
        return self.mode.format(mode=mode)


TRAINER_OPT_OUT = OptOut(
    setting="`safety_disable_rules`",
    disable="`safety_disable_rules=[<rule id>]` (CLI: `--safety_disable_rules <rule id>`)",
    mode='`safety_mode="{mode}"`',
)


class SafetyError(ValueError):
    """A configuration that a safety rule refuses, with every refused finding listed in one message.

    Attributes:
        findings (`tuple[Finding, ...]`):
            The findings that blocked construction, in rule order.
        opt_out (`OptOut`):
            How the message tells the user to skip a rule (config fields, or the OpenRLHF shim's flags).
    """

    def __init__(
        self, findings: "tuple[Finding, ...] | list[Finding]", header: str | None = None, opt_out: OptOut | None = None
    ):
        self.findings = tuple(findings)
        self.opt_out = opt_out or TRAINER_OPT_OUT
        count = len(self.findings)
        header = header or f"safe_trainers refused this configuration ({count} problem{'s' if count != 1 else ''}):"
        lines = [header] + [f"  [{f.rule_id}] {f.message}" for f in self.findings]
        lines.append(
            f"Fix the settings above, or skip a rule with {self.opt_out.disable}, or turn all rules off with "
            f"{self.opt_out.set_mode('off')}."
        )
        super().__init__("\n".join(lines))


class TrainingDivergedError(RuntimeError):
    """Training kept producing non-finite values after the allowed number of rollbacks.

    Attributes:
        checkpoint_dir (`str | None`):
            The checkpoint written from the last good state, or `None` if none could be written.
        report_path (`str | None`):
            The `nan_events.jsonl` file that lists every event of the run.
    """

    def __init__(self, message: str, checkpoint_dir: str | None = None, report_path: str | None = None):
        self.checkpoint_dir = checkpoint_dir
        self.report_path = report_path
        super().__init__(message)


class NonFiniteWeightsError(RuntimeError):
    """`save_model` or `push_to_hub` was asked to write weights that hold NaN or Inf.

    Attributes:
        tensors (`list[str]`):
            The names of the non-finite tensors (at most the first 10).
    """

    def __init__(self, output_dir: str, tensors: list[str]):
        self.tensors = tensors
        super().__init__(
            f"Refusing to save non-finite weights to {output_dir}: {', '.join(f'`{t}`' for t in tensors)} hold NaN or "
            "Inf. Nothing was written. The NaN guard keeps non-finite updates out of training, so these weights were "
            "changed outside it (after `train()`, or with `nan_guard=False`). Load the last clean checkpoint "
            "(`checkpoint-*` in `output_dir`; every one is verified finite), or resume from it with "
            "`trainer.train(resume_from_checkpoint=...)`, then save again."
        )


class UpstreamHookError(RuntimeError):
    """A hook of transformers' or TRL's training loop that the NaN guard depends on did not run in this process, so
    the run is not protected: raised (on every rank alike) as soon as the hook should have run.

    Attributes:
        hooks (`tuple[str, ...]`):
            The hooks that did not run, as `owner.name` (e.g. `transformers.Trainer._get_grad_norm`).
    """

    def __init__(self, message: str, hooks: "tuple[str, ...] | list[str]"):
        self.hooks = tuple(hooks)
        super().__init__(message)


class OutputDirInUseError(RuntimeError):
    """`train()` was refused because another live run holds the lock on the same `output_dir`
    (`restarts/output_lock.py`). A `RuntimeError`, as every run that cannot go on: not the `BlockingIOError` the lock
    call itself raises, which says only that a file is busy and would read as an I/O failure worth retrying.

    Attributes:
        output_dir (`str`): the directory in use.
        host (`str`): the host of the process that holds the lock (`""` if its lock file names none yet).
        pid (`int`): that process's id (0 if unknown).
    """

    def __init__(self, message: str, output_dir: str, host: str, pid: int):
        self.output_dir, self.host, self.pid = output_dir, host, pid
        super().__init__(message)
