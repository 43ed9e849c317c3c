"""Launch support: the shared logic of `launch/train_<kind>.py` (parse, build, train, save) and the GRPO/RLOO reward
functions selectable by name. `from safe_trainers.scripts import main` is the launch scripts' entry point."""

from .pipeline import ScriptArguments, build_trainer, main, make_parser, parse_args


__all__ = ["ScriptArguments", "build_trainer", "main", "make_parser", "parse_args"]
