"""`safe-trainers openrlhf`: command lines in, exact rewritten argv and finding ids out, for every flag generation."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap

import pytest

from safe_trainers.cli.main import main
from safe_trainers.errors import SafetyError
from safe_trainers.openrlhf import CommandError, Generation, generation_for_version, parse_command, sanitize, shim
from safe_trainers.openrlhf.generation_detection import detect_generations
from safe_trainers.openrlhf.flags import resolve
from safe_trainers.rules.families import family_from_name
from safe_trainers.rules.report import REMOVED, Change
from safe_trainers.testing.toy import save_toy_model


DS = ["deepspeed", "--module"]
GEMMA = "google/gemma-2-2b-it"  # recognised from the name: nothing named like this exists locally


@pytest.fixture(autouse=True)
def no_installed_openrlhf(monkeypatch):
    """Version detection must not depend on whether this machine has openrlhf installed."""
    monkeypatch.setattr(shim, "installed_openrlhf_version", lambda: None)
    monkeypatch.setattr(shim, "local_bf16_support", lambda: None)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Real local checkpoints; the directory names deliberately say nothing (or the wrong thing) about the family."""
    root = tmp_path_factory.mktemp("orl-models")
    return {
        "gemma2": save_toy_model(str(root / "my-reward-base"), "gemma2"),
        "qwen2": save_toy_model(str(root / "sft-checkpoint"), "qwen2"),
        "llama": save_toy_model(str(root / "gemma-2-2b-copy"), "llama"),  # config.json wins over the name
    }


def ids(report) -> list[str]:
    return [f.rule_id for f in report.findings]


def expand(tokens: list[str], models: dict[str, str]) -> list[str]:
    return [models[t[1:-1]] if t.startswith("{") and t.endswith("}") else t for t in tokens]


# (case id, command, expected argv, expected [(rule id, action)]). `{gemma2}` etc. are the local checkpoints.
CASES = [
    # <= 0.8.9: `--bf16` / `--flash_attn` / `--pretrain`
    (
        "legacy-rm-gemma-local",
        [*DS, "openrlhf.cli.train_rm", "--pretrain", "{gemma2}", "--bf16", "--flash_attn", "--max_norm", "0"],
        [*DS, "openrlhf.cli.train_rm", "--pretrain", "{gemma2}", "--bf16", "--max_norm", "1.0"],
        [("attention.gemma2_no_flash", "fixed"), ("optim.grad_clip", "fixed")],
    ),
    (
        "legacy-llama-config-beats-name",
        [*DS, "openrlhf.cli.train_rm", "--pretrain", "{llama}", "--bf16", "--flash_attn"],
        [*DS, "openrlhf.cli.train_rm", "--pretrain", "{llama}", "--bf16", "--flash_attn"],
        [],
    ),
    (
        "v0.3-kto-script-qwen2-vanilla",
        ["deepspeed", "../train_kto.py", "--pretrain", "{qwen2}", "--bf16", "--flash_attn", "--vanilla_loss", "--beta", "0.1"],  # noqa: E501
        ["deepspeed", "../train_kto.py", "--pretrain", "{qwen2}", "--bf16", "--flash_attn", "--beta", "0.1"],
        [("kto.qwen2_no_vanilla_loss", "fixed")],
    ),
    (
        "v0.3-kto-qwen2-by-name-prefix",
        ["deepspeed", "examples/train_kto.py", "--pretrain", "Qwen/Qwen2-7B-Instruct", "--flash_attn", "--vanilla"],
        ["deepspeed", "examples/train_kto.py", "--pretrain", "Qwen/Qwen2-7B-Instruct", "--flash_attn"],
        [("kto.qwen2_no_vanilla_loss", "fixed")],
    ),
    (
        # The empty-group NaN of `--vanilla_loss` does not depend on the model family (review of issue 9).
        "v0.3-kto-llama-vanilla-removed",
        ["deepspeed", "../train_kto.py", "--pretrain", "meta-llama/Llama-2-7b-hf", "--flash_attn", "--vanilla_loss"],
        ["deepspeed", "../train_kto.py", "--pretrain", "meta-llama/Llama-2-7b-hf", "--flash_attn"],
        [("kto.qwen2_no_vanilla_loss", "fixed")],
    ),
    # 0.8.10 - 0.9.1: `--bf16` + `--attn_implementation`
    (
        "attn-impl-dpo-gemma-local",
        [*DS, "openrlhf.cli.train_dpo", "--pretrain", "{gemma2}", "--bf16", "--attn_implementation", "flash_attention_2", "--packing_samples", "--beta", "0.1"],  # noqa: E501
        [*DS, "openrlhf.cli.train_dpo", "--pretrain", "{gemma2}", "--bf16", "--attn_implementation", "eager", "--beta", "0.1"],  # noqa: E501
        [("attention.gemma2_no_flash", "fixed")],
    ),
    (
        "attn-impl-sdpa-to-eager-inline",
        [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--bf16", "--attn_implementation=sdpa"],
        [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--bf16", "--attn_implementation=eager"],
        [("attention.gemma2_no_flash", "fixed")],
    ),
    (
        "attn-impl-eager-but-packing",
        [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--bf16", "--attn_implementation", "eager", "--packing_samples"],  # noqa: E501
        [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--bf16", "--attn_implementation", "eager"],
        [("attention.gemma2_no_flash", "fixed")],
    ),
    # 0.9.2 - 0.10.1: `--param_dtype`
    (
        "param-dtype-qwen-fp16-and-nan-clip",
        [*DS, "openrlhf.cli.train_rm", "--pretrain", "{qwen2}", "--param_dtype", "fp16", "--max_norm=nan"],
        [*DS, "openrlhf.cli.train_rm", "--pretrain", "{qwen2}", "--param_dtype", "bf16", "--max_norm=1.0"],
        [("precision.bf16_over_fp16", "fixed"), ("optim.grad_clip", "fixed")],
    ),
    (
        "param-dtype-gemma-absent-attn-means-flash",
        [*DS, "openrlhf.cli.train_sft", "--pretrain", GEMMA, "--param_dtype", "fp16", "--local_rank=0"],
        [*DS, "openrlhf.cli.train_sft", "--pretrain", GEMMA, "--param_dtype", "bf16", "--local_rank=0", "--attn_implementation", "eager"],  # noqa: E501
        [("precision.bf16_over_fp16", "fixed"), ("attention.gemma2_no_flash", "fixed")],
    ),
    (
        "param-dtype-ppo-ray-dynamic-batch",
        ["python3", "-m", "openrlhf.cli.train_ppo_ray", "--pretrain", GEMMA, "--param_dtype", "bf16", "--use_dynamic_batch", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8"],  # noqa: E501
        ["python3", "-m", "openrlhf.cli.train_ppo_ray", "--pretrain", GEMMA, "--param_dtype", "bf16", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8", "--attn_implementation", "eager"],  # noqa: E501
        [("attention.gemma2_no_flash", "fixed")],
    ),
    # >= 0.10.2: dotted names, prefixes, nargs="*" lists
    (
        "dotted-rm-gemma-local",
        [*DS, "openrlhf.cli.train_rm", "--model.model_name_or_path", "{gemma2}", "--ds.param", "fp16", "--ds.packing_samples", "--max_norm", "-1", "--ds.lora.target_modules", "q_proj", "v_proj", "--local_rank=0"],  # noqa: E501
        [*DS, "openrlhf.cli.train_rm", "--model.model_name_or_path", "{gemma2}", "--ds.param", "bf16", "--max_norm", "1.0", "--ds.lora.target_modules", "q_proj", "v_proj", "--local_rank=0", "--ds.attn_implementation", "eager"],  # noqa: E501
        [("precision.bf16_over_fp16", "fixed"), ("attention.gemma2_no_flash", "fixed"), ("optim.grad_clip", "fixed")],
    ),
    (
        "dotted-ppo-actor-critic-clip",
        ["python3", "-m", "openrlhf.cli.train_ppo_ray", "--actor.model_name_or_path", "Qwen/Qwen3-8B", "--actor.max_norm", "0", "--critic.max_norm", "inf", "--algo.advantage.estimator", "rloo", "--rollout.n_samples_per_prompt", "8"],  # noqa: E501
        ["python3", "-m", "openrlhf.cli.train_ppo_ray", "--actor.model_name_or_path", "Qwen/Qwen3-8B", "--actor.max_norm", "1.0", "--critic.max_norm", "1.0", "--algo.advantage.estimator", "rloo", "--rollout.n_samples_per_prompt", "8"],  # noqa: E501
        [("optim.grad_clip", "fixed")],
    ),
    (
        "dotted-muon-wants-no-clipping",
        [*DS, "openrlhf.cli.train_sft", "--model.model_name_or_path", "Qwen/Qwen3-8B", "--optim", "muon", "--max_norm", "0"],  # noqa: E501
        [*DS, "openrlhf.cli.train_sft", "--model.model_name_or_path", "Qwen/Qwen3-8B", "--optim", "muon", "--max_norm", "0"],  # noqa: E501
        [],
    ),
    (
        "dotted-ambiguous-prefix-left-alone",
        [*DS, "openrlhf.cli.train_rm", "--model.model_name_or_path", "Qwen/Qwen2-7B", "--ds.pa", "fp16"],
        [*DS, "openrlhf.cli.train_rm", "--model.model_name_or_path", "Qwen/Qwen2-7B", "--ds.pa", "fp16"],
        [],
    ),
]


@pytest.mark.parametrize("case, command, expected, findings", CASES, ids=[c[0] for c in CASES])
def test_rewrites(models, case, command, expected, findings):
    argv, report = sanitize(expand(command, models))
    assert argv == expand(expected, models)
    assert [(f.rule_id, f.action) for f in report.findings] == findings


@pytest.mark.parametrize(
    "command, generations",
    [
        (["--flash_attn"], (Generation.LEGACY,)),
        (["--bf16", "--attn_implementation", "eager"], (Generation.ATTN_IMPL,)),
        (["--attn_implementation", "eager"], (Generation.PARAM_DTYPE, Generation.ATTN_IMPL)),
        (["--param", "fp16"], (Generation.PARAM_DTYPE,)),  # unique prefix of --param_dtype
        (["--bf16", "--pretrain", "x"], (Generation.ATTN_IMPL, Generation.LEGACY)),
        (["--ds.param_dtype", "bf16"], (Generation.DOTTED,)),
        (["--pretrain", "x"], (Generation.PARAM_DTYPE, Generation.ATTN_IMPL, Generation.LEGACY)),
        (["--max_norm", "1"], (Generation.DOTTED, Generation.PARAM_DTYPE, Generation.ATTN_IMPL, Generation.LEGACY)),
    ],
)
def test_flag_style_detection(command, generations):
    assert detect_generations(parse_command([*DS, "openrlhf.cli.train_rm", *command]))[0] == generations


def test_mixed_generations_is_a_parse_error():
    with pytest.raises(CommandError, match="--attn_implementation"):
        detect_generations(parse_command([*DS, "openrlhf.cli.train_rm", "--flash_attn", "--attn_implementation", "x"]))


@pytest.mark.parametrize(
    "version, generation",
    [("0.3.3", "LEGACY"), ("0.8.9.post1", "LEGACY"), ("0.8.10", "ATTN_IMPL"), ("0.9.1.post1", "ATTN_IMPL"),
     ("0.9.2", "PARAM_DTYPE"), ("v0.10.1.post2", "PARAM_DTYPE"), ("0.10.2", "DOTTED"), ("0.11.2", "DOTTED")],
)  # fmt: skip
def test_generation_for_version(version, generation):
    assert generation_for_version(version) is Generation[generation]


def test_prefix_resolution_follows_argparse():
    assert resolve("--ds.param", Generation.DOTTED, "train_rm") == "--ds.param_dtype"
    assert resolve("--ds.pa", Generation.DOTTED, "train_rm") is None  # also --ds.packing_samples
    assert resolve("--max_n", Generation.LEGACY, "train_rm") == "--max_norm"
    assert resolve("--pretrain", Generation.LEGACY, "train_ppo_ray") == "--pretrain"  # exact, though --pretrain_data
    assert resolve("--pretrai", Generation.LEGACY, "train_ppo_ray") is None


@pytest.mark.parametrize(
    "name, family",
    [("Qwen/Qwen2-7B", "qwen2"), ("Qwen/Qwen2.5-7B-Instruct", "qwen2"), ("Qwen/Qwen1.5-7B", "qwen2"),
     ("Qwen/Qwen3-30B-A3B", "qwen3_moe"), ("google/gemma-2-2b-it", "gemma2"),
     ("/ckpt/gemma2-9b/checkpoint-100", "gemma2"),
     ("google/gemma-2b", "gemma"), ("google/gemma-1.1-2b-it", "gemma"), ("google/gemma-3-1b-it", "gemma3"),
     ("meta-llama/Meta-Llama-3-8B", "llama"), ("bigscience/bloomz-1b7", None)],
)  # fmt: skip
def test_family_from_name(name, family):
    assert family_from_name(name) == family


def test_change_records_and_passthrough_of_unknown_flags():
    template = "User: {}\nAssistant: "
    command = [*DS, "openrlhf.cli.train_rm", "--zzz_unknown", "1", "--pretrain", GEMMA, "--input_template", template,
               "--flash_attn", "--max_n", "0", "--max_norm", "0.5", "--max_norm", "0", "--bf16", "--unknown_switch",
               "--local_rank=3"]  # fmt: skip
    argv, report = sanitize(command)
    assert argv == [*DS, "openrlhf.cli.train_rm", "--zzz_unknown", "1", "--pretrain", GEMMA, "--input_template",
                    template, "--max_n", "0", "--max_norm", "0.5", "--max_norm", "1.0", "--bf16", "--unknown_switch",
                    "--local_rank=3"]  # fmt: skip
    assert report.changes == [Change("argv.--flash_attn", True, REMOVED), Change("argv.--max_norm", "0", "1.0")]


@pytest.mark.parametrize(
    "launcher",
    [
        ["deepspeed", "--num_gpus", "8", "--master_port", "1234", "--module", "openrlhf.cli.train_rm"],
        ["deepspeed", "--include", "localhost:0,1", "--module", "openrlhf.cli.train_rm"],
        ["torchrun", "--nproc_per_node", "8", "-m", "openrlhf.cli.train_rm"],
        ["ray", "job", "submit", "--address=http://127.0.0.1:8265", "--", "python3", "-m", "openrlhf.cli.train_rm"],
    ],
)
def test_launcher_options_survive(launcher):
    argv, report = sanitize([*launcher, "--pretrain", GEMMA, "--bf16", "--flash_attn", "--max_norm=0"])
    assert argv == [*launcher, "--pretrain", GEMMA, "--bf16", "--max_norm=1.0"]
    assert ids(report) == ["attention.gemma2_no_flash", "optim.grad_clip"]


def test_ambiguous_generation_is_refused_when_one_candidate_needs_a_flag_another_rejects():
    # <= 0.8.9 loads eager without `--flash_attn`; 0.8.10-0.9.1 defaults to flash_attention_2 and needs
    # `--attn_implementation eager`, which <= 0.8.9 rejects: no rewrite is valid in both, and one trains to NaN.
    command = [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--bf16"]
    with pytest.raises(SafetyError, match="OpenRLHF 0.8.10-0.9.1 needs argv.--attn_implementation") as error:
        sanitize(command)
    assert "--openrlhf-version" in str(error.value)
    argv, _ = sanitize(command, version="0.9.0")
    assert argv == [*command, "--attn_implementation", "eager"]


def test_legacy_packing_forces_flash_back():
    """<= 0.8.9 has eager attention without `--flash_attn`, but `--packing_samples` turns flash back on."""
    command = [*DS, "openrlhf.cli.train_sft", "--pretrain", GEMMA, "--bf16", "--packing_samples", "--zero_stage", "2"]
    argv, report = sanitize(command, version="0.8.9")
    assert argv == [*DS, "openrlhf.cli.train_sft", "--pretrain", GEMMA, "--bf16", "--zero_stage", "2"]
    assert report.changes == [Change("argv.--packing_samples", True, REMOVED)]
    with pytest.raises(SafetyError, match="Valid in every candidate release: argv.--packing_samples"):
        sanitize(command)  # `--bf16`: <= 0.8.9 or 0.8.10-0.9.1, and the latter also needs an attention flag


def test_installed_version_wins_over_flag(monkeypatch):
    command = [*DS, "openrlhf.cli.train_rm", "--model.model_name_or_path", GEMMA, "--max_norm", "0"]
    result = shim.plan(command, version="0.8.9", installed=lambda: "0.11.2")
    assert result.generations == (Generation.DOTTED,) and "installed openrlhf 0.11.2" in result.version_source
    assert result.argv == [*DS, "openrlhf.cli.train_rm", "--model.model_name_or_path", GEMMA, "--max_norm", "1.0",
                           "--ds.attn_implementation", "eager"]  # fmt: skip


@pytest.mark.parametrize(
    "command, rule_id",
    [
        (["python", "-m", "openrlhf.cli.train_ppo_ray", "--pretrain", "Qwen/Qwen2-7B", "--param_dtype", "bf16",
          "--advantage_estimator", "group_norm"], "grpo.group_size"),
        (["python", "-m", "openrlhf.cli.train_ppo_ray", "--ds.param_dtype", "bf16", "--algo.advantage.estimator",
          "dr_grpo", "--rollout.n_samples_per_prompt", "4", "--rollout.temperature", "0"], "grpo.group_size"),
        ([*DS, "openrlhf.cli.train_dpo", "--model.model_name_or_path", "Qwen/Qwen2-7B", "--model.beta", "nan"],
         "dpo.beta_positive"),
        ([*DS, "openrlhf.cli.train_dpo", "--model.model_name_or_path", "Qwen/Qwen2-7B", "--model.beta", "0",
          "--model.ipo_enable"], "dpo.beta_positive"),
        ([*DS, "openrlhf.cli.train_rm", "--model.model_name_or_path", GEMMA, "--ds.ring_attn_size", "2",
          "--ds.packing_samples"], "attention.gemma2_no_flash"),
    ],
)  # fmt: skip
def test_blocked(command, rule_id):
    with pytest.raises(SafetyError) as error:
        sanitize(command)
    assert [f.rule_id for f in error.value.findings] == [rule_id]


@pytest.mark.parametrize(
    "command, fragment",
    [
        ([*DS, "openrlhf.cli.train_dpo", "--model.model_name_or_path", "Qwen/Qwen2-7B", "--model.beta", "0"],
         "learns nothing"),
        (["deepspeed", "train_kto.py", "--pretrain", "meta-llama/Llama-2-7b", "--beta", "-0.1"], "rejected answers"),
    ],
)  # fmt: skip
def test_beta_zero_or_negative_is_warned_not_refused(command, fragment):
    # OpenRLHF trains these (a constant loss, or the wrong direction): a warning, the command runs as given
    argv, report = sanitize(command)
    assert argv == command
    (finding,) = report.by_rule("dpo.beta_positive")
    assert finding.action == "warned" and fragment in finding.message


def test_kto_vanilla_loss_with_a_micro_batch_of_one_is_fixed_not_refused():
    command = ["deepspeed", "train_kto.py", "--pretrain", "meta-llama/Llama-2-7b", "--flash_attn", "--vanilla_loss",
               "--micro_train_batch_size", "1"]  # fmt: skip
    argv, report = sanitize(command)
    assert "--vanilla_loss" not in argv and argv == [t for t in command if t != "--vanilla_loss"]
    (finding,) = report.by_rule("kto.qwen2_no_vanilla_loss")  # removed for every family, before the batch rule
    assert finding.action == "fixed" and "mean over nothing" in finding.message
    assert all(f.action != "blocked" for f in report.findings)


def test_fp16_without_bf16_hardware():
    llama = [*DS, "openrlhf.cli.train_rm", "--pretrain", "meta-llama/Llama-3-8B", "--param_dtype", "fp16"]
    argv, report = sanitize(llama, bf16_supported=False)
    assert argv == llama
    assert [(f.rule_id, f.action) for f in report.findings] == [("precision.bf16_over_fp16", "warned")]
    gemma = [*DS, "openrlhf.cli.train_rm", "--pretrain", "google/gemma-3-1b-it", "--param_dtype", "fp16"]
    with pytest.raises(SafetyError, match="gemma3"):
        sanitize(gemma, bf16_supported=False)


def test_disabled_rule_is_skipped_and_not_applied():
    command = [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--flash_attn", "--max_norm", "0"]
    argv, report = sanitize(command, disabled=["attention.gemma2_no_flash"])
    assert argv == [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--flash_attn", "--max_norm", "1.0"]
    assert [(f.rule_id, f.action) for f in report.findings] == [
        ("attention.gemma2_no_flash", "skipped"),
        ("optim.grad_clip", "fixed"),
    ]


def test_warn_mode_reports_and_keeps_the_command():
    command = [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--flash_attn"]
    argv, report = sanitize(command, mode="warn")
    assert argv == command and [f.action for f in report.findings] == ["warned"]


# --- the edge: printing, exit codes, running without a shell ---


class FakeRunner:
    def __init__(self, returncode: int = 0):
        self.calls: list[tuple[tuple, dict]] = []
        self.returncode = returncode

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return subprocess.CompletedProcess(args[0], self.returncode)


def test_run_passes_an_argument_list_and_the_exit_code(capsys):
    runner = FakeRunner(returncode=-9)  # killed by SIGKILL
    code = shim.run([*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--flash_attn"], runner=runner)
    assert code == 137
    assert runner.calls == [(([*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA],), {})]  # no shell=True
    assert "[fixed] attention.gemma2_no_flash" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, token",
    [
        ([*DS, "foo.bar", "--bf16"], "foo.bar"),
        ([*DS, "openrlhf.cli.train_rm", "--bf16", "--max_norm", "--flash_attn"], "--max_norm"),
        ([*DS, "openrlhf.cli.train_rm", "--bf16", "--max_n", "abc"], "--max_n"),
        ([*DS, "openrlhf.cli.train_rm", "--flash_attn", "--attn_implementation", "eager"], "--attn_implementation"),
        ([], "no command"),
    ],
)
def test_unreadable_command_exits_2_and_runs_nothing(capsys, command, token):
    runner = FakeRunner()
    assert shim.run(command, runner=runner) == 2
    assert runner.calls == []
    assert token in capsys.readouterr().err


def test_strict_exits_1_and_runs_nothing(capsys):
    runner = FakeRunner()
    command = [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--max_norm", "0"]
    code = shim.run(command, mode="strict", runner=runner)
    assert code == 1 and runner.calls == []
    assert "[optim.grad_clip]" in capsys.readouterr().err


def test_off_runs_unchanged_without_parsing():
    runner = FakeRunner(returncode=5)
    assert shim.run(["echo", "--flash_attn"], mode="off", runner=runner) == 5
    assert runner.calls == [((["echo", "--flash_attn"],), {})]


def test_missing_launcher_exits_127(capsys):
    assert shim.run(["no-such-launcher-xyz", "--module", "openrlhf.cli.train_rm", "--bf16"]) == 127
    assert "no-such-launcher-xyz" in capsys.readouterr().err


def test_cli_dry_run_prints_a_shlex_quoted_command(capsys):
    code = main(["openrlhf", "--dry-run", "--", *DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--flash_attn",
                 "--input_template", "User: {}; $HOME", "--max_norm", "0"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0
    assert out.strip() == shlex.join(
        [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--input_template", "User: {}; $HOME", "--max_norm", "1.0"]
    )
    assert "'User: {}; $HOME'" in out
    assert "2 fixed" in err and "argv.--max_norm: '0' -> '1.0'" in err


def test_cli_options_and_errors(capsys):
    command = [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--bf16", "--max_norm", "0"]
    assert main(["openrlhf", "--dry-run", "--openrlhf-version", "0.9.0", "--", *command]) == 0
    assert capsys.readouterr().out.split() == [*command[:-1], "1.0", "--attn_implementation", "eager"]
    assert main(["openrlhf", "--dry-run", "--safety_disable_rules", "optim.grad_clip,attention.gemma2_no_flash",
                 "--", *command]) == 0  # fmt: skip
    assert capsys.readouterr().out.split() == command
    assert main(["openrlhf", "--safety-disable-rules", "no.such_rule", "--", *command]) == 2
    assert "no.such_rule" in capsys.readouterr().err
    assert main(["openrlhf", "--safety-mode", "strict", "--", *command]) == 1


def test_cli_runs_the_rewritten_command_without_a_shell(tmp_path, capsys, monkeypatch):
    """The "launcher" is this Python running a `train_rm.py` (the pre-0.3.6 script form) that records its argv."""
    monkeypatch.chdir(tmp_path)  # a shell would run `touch nope` here
    record = tmp_path / "argv.json"
    script = tmp_path / "train_rm.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, sys
            with open({str(record)!r}, "w") as f:
                json.dump(sys.argv[1:], f)
            sys.exit(3)
            """
        )
    )
    hostile = ["User: {} $HOME; echo pwned", "$(touch nope) `id` > out | cat", "*"]
    code = main(["openrlhf", "--", sys.executable, str(script), "--pretrain", GEMMA, "--bf16", "--flash_attn",
                 "--input_template", hostile[0], "--save_path", hostile[1], "--eval_dataset", hostile[2],
                 "--max_norm", "0", "--local_rank=0"])  # fmt: skip
    assert code == 3
    assert json.loads(record.read_text()) == ["--pretrain", GEMMA, "--bf16", "--input_template", hostile[0],
                                              "--save_path", hostile[1], "--eval_dataset", hostile[2], "--max_norm",
                                              "1.0", "--local_rank=0"]  # fmt: skip
    assert not (tmp_path / "nope").exists()
    assert "attention.gemma2_no_flash" in capsys.readouterr().err


def test_messages_name_the_shims_flags_not_python_syntax(capsys):
    blocked = [*DS, "openrlhf.cli.train_dpo", "--model.model_name_or_path", "Qwen/Qwen2-7B", "--model.beta", "nan"]
    assert shim.run(blocked, runner=FakeRunner()) == 1
    err = capsys.readouterr().err
    assert "`--safety-disable-rules <rule id>`" in err and "`--safety-mode off`" in err
    assert "safety_disable_rules=[" not in err and 'safety_mode="off"' not in err

    fixed = [*DS, "openrlhf.cli.train_rm", "--pretrain", GEMMA, "--flash_attn", "--max_norm", "0"]
    assert shim.run(fixed, disabled=["optim.grad_clip"], runner=FakeRunner()) == 0
    err = capsys.readouterr().err
    assert "Disable a rule with `--safety-disable-rules <rule id>`." in err
    assert "disabled by `--safety-disable-rules`." in err and "safety_disable_rules" not in err

    assert shim.run(fixed, mode="warn", runner=FakeRunner()) == 0
    assert "(not applied: `--safety-mode warn`)" in capsys.readouterr().err
    with pytest.raises(SafetyError, match=r"\(not applied: `--safety-mode strict` raises instead of fixing\)"):
        sanitize(fixed, mode="strict")
