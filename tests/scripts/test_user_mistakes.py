"""More of the user's mistakes the launch scripts answer with one message and exit status 2 (issue 23, item 1), found
by trying to break that contract; run in process through the scripts' entry point (`launch/train_<kind>.py` is
`entry.run(kind)`), and in `safe-trainers check` where it judges the same setting."""

from __future__ import annotations

import pytest

from safe_trainers.cli.main import main as cli
from safe_trainers.scripts import entry


def refused(capsys, kind: str, argv: list[str]) -> str:
    """Run `launch/train_<kind>.py <argv>` in process: it must exit 2 with one `train_<kind>: error:` message, which
    is returned."""
    with pytest.raises(SystemExit) as exit_:
        entry.run(kind, argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.count(f"train_{kind}: error:") == 1 and "Traceback" not in err, err
    return err[err.index(f"train_{kind}: error:") :]


BELOW_ONE = [("per_device_train_batch_size", "0"), ("per_device_train_batch_size", "-1"),
             ("gradient_accumulation_steps", "0")]  # fmt: skip


@pytest.mark.parametrize("flag, value", BELOW_ONE)
def test_a_batch_size_below_one_before_any_model(flag, value, tmp_path, capsys):
    # was: torch's "batch_size should be a positive integer value" (or a ZeroDivisionError in transformers'
    # training loop) in a traceback, after the model loaded; `check` exited 0
    message = refused(capsys, "dpo", [f"--{flag}", value, "--output_dir", str(tmp_path / "out")])
    assert f"`{flag}={int(value)}` is not a positive number" in message and f"`--{flag} " in message
    assert not (tmp_path / "out" / "toy-model").exists()  # refused before even the toy model was built
    config = tmp_path / "config.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\n")
    assert cli(["check", "--trainer", "dpo", "--config", str(config), f"--{flag}", value]) == 2
    assert f"`{flag}={int(value)}` is not a positive number" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, fragment",
    [("no_such_module_xyz:reward", "Could not import module `no_such_module_xyz`"),
     ("safe_trainers.scripts.rewards:nothing_here", "has no callable `nothing_here`")],
)  # fmt: skip
def test_a_reward_path_that_does_not_resolve(name, fragment, tmp_path, capsys):
    # was: the same text inside a ValueError traceback (the form is fine, so the start-up name check let it through)
    message = refused(capsys, "grpo", ["--reward_funcs", name, "--output_dir", str(tmp_path / "out")])
    assert fragment in message and f"{name!r} in `reward_funcs`" in message
    assert not (tmp_path / "out" / "toy-model").exists()  # before any data or weight
