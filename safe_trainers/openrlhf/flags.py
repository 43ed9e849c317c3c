"""OpenRLHF flag names per release generation, and argparse-style prefix resolution.

OpenRLHF renamed its precision and attention flags three times and then moved every flag to a dotted namespace:

| Generation | Releases | Precision (absent means) | Attention (absent means) |
|---|---|---|---|
| `LEGACY` | <= 0.8.9 | `--bf16` (fp32) | `--flash_attn` (eager) |
| `ATTN_IMPL` | 0.8.10 - 0.9.1 | `--bf16` (fp32) | `--attn_implementation` (flash_attention_2) |
| `PARAM_DTYPE` | 0.9.2 - 0.10.1.post2 | `--param_dtype {bf16,fp16}` (bf16) | `--attn_implementation` (flash_attention_2) |
| `DOTTED` | >= 0.10.2 | `--ds.param_dtype {bf16,fp16}` (bf16) | `--ds.attn_implementation` (flash_attention_2) |

Every OpenRLHF parser is a plain `argparse.ArgumentParser()` with `allow_abbrev=True`, so a unique prefix of a flag
works as the flag (`--ds.param fp16` is `--ds.param_dtype fp16`) and an ambiguous one is an error. `ABBREVIATIONS`
holds, for every flag the rules read, its shortest unique prefix in each generation and entry point, written
`"<shortest prefix>|<rest>"`. It was computed from the argparse blocks of every tagged OpenRLHF release (v0.0.1 to
v0.11.0) and the 0.11.2 wheel (`serve_rm` and `batch_inference` from the `openrlhf.cli` releases that have them,
`batch_inference` also from the `examples/batch_inference.py` of the releases before 0.3.6): within one generation
the union of all releases' flags is used, so a prefix counts as unique only if it is unique in every release of that
generation (otherwise it is left alone).
"""

from __future__ import annotations

from enum import Enum


class Generation(str, Enum):
    """A range of OpenRLHF releases that share flag names (value: the release range, for messages)."""

    LEGACY = "<=0.8.9"
    ATTN_IMPL = "0.8.10-0.9.1"
    PARAM_DTYPE = "0.9.2-0.10.1"
    DOTTED = ">=0.10.2"

    def __str__(self) -> str:
        return self.value


LEGACY, ATTN_IMPL, PARAM_DTYPE, DOTTED = Generation
# Newest first: the order of candidates when the command's flags fit several generations.
GENERATIONS: tuple[Generation, ...] = (DOTTED, PARAM_DTYPE, ATTN_IMPL, LEGACY)
FLAT = (LEGACY, ATTN_IMPL, PARAM_DTYPE)

TRAINERS = (
    "train_sft", "train_rm", "train_dpo", "train_kto", "train_ppo", "train_ppo_ray", "train_prm", "train_kd",
)  # fmt: skip
# Entry points that load a model without training it: serving a reward model (remote RM pipelines) and batch
# generation or scoring (rejection sampling, iterative DPO). Their models run through the same attention and precision
# code as the trainers', so the same rules apply to them; the training rules find no flag of theirs to read.
SERVING = ("serve_rm", "batch_inference")
ENTRY_POINTS = TRAINERS + SERVING

# fmt: off
ABBREVIATIONS: dict[Generation, dict[str, str]] = {
    LEGACY: {
        "*": "--bf|16 --fl|ash_attn --pac|king_samples --ring_a|ttn_size --use_dy|namic_batch --max_n|orm --pretrain| --ref_p|retrain --reward_p|retrain --critic_p|retrain --be|ta --n_|samples_per_prompt --adv|antage_estimator --tem|perature --van|illa_loss --micro_t|rain_batch_size",
        "train_sft": "--bf|16 --fl|ash_attn --pac|king_samples --ring_a|ttn_size --max_n|orm --pretrain| --mi|cro_train_batch_size",
        "train_rm": "--bf|16 --fl|ash_attn --pac|king_samples --ring_a|ttn_size --max_n|orm --pre|train --mi|cro_train_batch_size",
        "train_dpo": "--bf|16 --fl|ash_attn --pa|cking_samples --ring_a|ttn_size --max_n|orm --pre|train --ref_p|retrain --be|ta --mic|ro_train_batch_size",
        "train_kto": "--bf|16 --fl|ash_attn --max_n|orm --pre|train --be|ta --v|anilla_loss --mi|cro_train_batch_size",
        "train_ppo": "--bf|16 --fl|ash_attn --max_n|orm --pretrain| --reward_p|retrain --critic_p|retrain --n_|samples_per_prompt --adv|antage_estimator --te|mperature --micro_t|rain_batch_size",
        "train_ppo_ray": "--bf|16 --fl|ash_attn --pac|king_samples --ring_a|ttn_size --use_dy|namic_batch --max_n|orm --pretrain| --reward_p|retrain --critic_p|retrain --n_|samples_per_prompt --adv|antage_estimator --te|mperature --micro_t|rain_batch_size",
        "train_prm": "--b|f16 --fl|ash_attn --pa|cking_samples --max_n|orm --pr|etrain --mi|cro_train_batch_size",
        "train_kd": "--bf|16 --fl|ash_attn --max_n|orm --pretrain| --mi|cro_train_batch_size",
        "serve_rm": "--bf|16 --f|lash_attn --pa|cking_samples --r|eward_pretrain",
        "batch_inference": "--bf|16 --fl|ash_attn --pre|train --te|mperature",
    },
    ATTN_IMPL: {
        "*": "--bf|16 --at|tn_implementation --pa|cking_samples --ring_a|ttn_size --use_dy|namic_batch --max_n|orm --pretrain| --ref_p|retrain --reward_p|retrain --critic_p|retrain --be|ta --n_|samples_per_prompt --adv|antage_estimator --tem|perature --micro_t|rain_batch_size",
        "train_sft": "--b|f16 --at|tn_implementation --pa|cking_samples --ring_a|ttn_size --max_n|orm --pretrain| --mi|cro_train_batch_size",
        "train_rm": "--b|f16 --at|tn_implementation --pa|cking_samples --ring_a|ttn_size --max_n|orm --pre|train --mi|cro_train_batch_size",
        "train_dpo": "--bf|16 --at|tn_implementation --pa|cking_samples --ring_a|ttn_size --max_n|orm --pre|train --ref_p|retrain --be|ta --mic|ro_train_batch_size",
        "train_kto": "--bf|16 --at|tn_implementation --max_n|orm --p|retrain --be|ta --mi|cro_train_batch_size",
        "train_ppo_ray": "--b|f16 --at|tn_implementation --pa|cking_samples --ring_a|ttn_size --use_dy|namic_batch --max_n|orm --pre|train --reward_p|retrain --critic_p|retrain --n_|samples_per_prompt --adv|antage_estimator --te|mperature --micro_t|rain_batch_size",
        "train_prm": "--b|f16 --at|tn_implementation --pa|cking_samples --max_n|orm --pr|etrain --mi|cro_train_batch_size",
        "train_kd": "--b|f16 --at|tn_implementation --max_n|orm --pretrain| --mi|cro_train_batch_size",
        "serve_rm": "--a|ttn_implementation --bf|16 --pa|cking_samples --r|eward_pretrain",
        "batch_inference": "--at|tn_implementation --bf|16 --pre|train --te|mperature",
    },
    PARAM_DTYPE: {
        "*": "--at|tn_implementation --para|m_dtype --pac|king_samples --ring_a|ttn_size --use_dy|namic_batch --max_no|rm --pretrain| --ref_p|retrain --reward_p|retrain --critic_p|retrain --bet|a --n_|samples_per_prompt --adv|antage_estimator --tem|perature --micro_t|rain_batch_size",
        "train_sft": "--at|tn_implementation --par|am_dtype --pac|king_samples --ring_a|ttn_size --max_n|orm --pretrain| --mi|cro_train_batch_size",
        "train_rm": "--at|tn_implementation --par|am_dtype --pac|king_samples --ring_a|ttn_size --max_n|orm --pre|train --mi|cro_train_batch_size",
        "train_dpo": "--at|tn_implementation --par|am_dtype --pac|king_samples --ring_a|ttn_size --max_n|orm --pre|train --ref_p|retrain --b|eta --mic|ro_train_batch_size",
        "train_kto": "--at|tn_implementation --pa|ram_dtype --max_n|orm --pr|etrain --b|eta --mi|cro_train_batch_size",
        "train_ppo_ray": "--at|tn_implementation --para|m_dtype --pac|king_samples --ring_a|ttn_size --use_dy|namic_batch --max_no|rm --pre|train --reward_p|retrain --critic_p|retrain --n_|samples_per_prompt --adv|antage_estimator --te|mperature --micro_t|rain_batch_size",
        "train_prm": "--at|tn_implementation --par|am_dtype --pac|king_samples --max_n|orm --pr|etrain --mi|cro_train_batch_size",
        "train_kd": "--at|tn_implementation --pa|ram_dtype --max_n|orm --pretrain| --mi|cro_train_batch_size",
        "serve_rm": "--a|ttn_implementation --pac|king_samples --par|am_dtype --r|eward_pretrain",
        "batch_inference": "--at|tn_implementation --pa|ram_dtype --pre|train --te|mperature",
    },
    DOTTED: {
        "*": "--ds.par|am_dtype --ds.at|tn_implementation --ds.pac|king_samples --ds.ring_attn_s|ize --train.d|ynamic_batch_enable --ma|x_norm --actor.ma|x_norm --critic.ma|x_norm --o|ptim --actor.o|ptim --critic.o|ptim --model.mo|del_name_or_path --ref.m|odel_name_or_path --actor.mo|del_name_or_path --reward.m|odel_name_or_path --critic.mo|del_name_or_path --model.b|eta --rollout.n|_samples_per_prompt --algo.advantage.e|stimator --rollout.te|mperature",
        "train_sft": "--ds.par|am_dtype --ds.at|tn_implementation --ds.pac|king_samples --ds.ring_attn_s|ize --ma|x_norm --o|ptim --model.m|odel_name_or_path",
        "train_rm": "--ds.par|am_dtype --ds.at|tn_implementation --ds.pac|king_samples --ds.ring_attn_s|ize --ma|x_norm --o|ptim --model.mo|del_name_or_path",
        "train_dpo": "--ds.par|am_dtype --ds.at|tn_implementation --ds.pac|king_samples --ds.ring_attn_s|ize --ma|x_norm --o|ptim --model.m|odel_name_or_path --ref.m|odel_name_or_path --model.b|eta",
        "train_ppo_ray": "--ds.par|am_dtype --ds.at|tn_implementation --ds.pac|king_samples --ds.ring_attn_s|ize --train.d|ynamic_batch_enable --actor.ma|x_norm --critic.ma|x_norm --actor.o|ptim --critic.o|ptim --actor.mo|del_name_or_path --reward.m|odel_name_or_path --critic.mo|del_name_or_path --rollout.n|_samples_per_prompt --algo.advantage.e|stimator --rollout.te|mperature",
        "serve_rm": "--ds.a|ttn_implementation --ds.pac|king_samples --ds.par|am_dtype --reward.m|odel_name_or_path",
    },
}
# fmt: on

# The flat (undotted) flags that still exist in >= 0.10.2: a command using only these fits every generation.
DOTTED_FLAT_FLAGS = frozenset(
    {"--max_norm", "--optim", "--local_rank", "--lr_scheduler", "--lr_warmup_ratio", "--min_lr_ratio", "--use_ms",
     "--help"}
)  # fmt: skip


def _by_generation(legacy: tuple[str, ...], attn: tuple[str, ...], dtype: tuple[str, ...], dotted: tuple[str, ...]):
    return {LEGACY: legacy, ATTN_IMPL: attn, PARAM_DTYPE: dtype, DOTTED: dotted}


_MODELS_FLAT = ("--pretrain", "--ref_pretrain", "--reward_pretrain", "--critic_pretrain")
_MODELS_DOTTED = tuple(f"--{p}.model_name_or_path" for p in ("model", "ref", "actor", "reward", "critic"))

# The flags behind each concern the rules read, per generation (filtered by entry point with `flags_for`).
CONCERNS: dict[str, dict[Generation, tuple[str, ...]]] = {
    "precision": _by_generation(("--bf16",), ("--bf16",), ("--param_dtype",), ("--ds.param_dtype",)),
    "attention": _by_generation(("--flash_attn",), ("--attn_implementation",), ("--attn_implementation",), ("--ds.attn_implementation",)),  # noqa: E501
    "packing": _by_generation(*[("--packing_samples",)] * 3, ("--ds.packing_samples",)),
    "ring": _by_generation(*[("--ring_attn_size",)] * 3, ("--ds.ring_attn_size",)),
    "dynamic_batch": _by_generation(*[("--use_dynamic_batch",)] * 3, ("--train.dynamic_batch_enable",)),
    "max_norm": _by_generation(*[("--max_norm",)] * 3, ("--max_norm", "--actor.max_norm", "--critic.max_norm")),
    "optim": _by_generation((), (), (), ("--optim", "--actor.optim", "--critic.optim")),
    "model": _by_generation(_MODELS_FLAT, _MODELS_FLAT, _MODELS_FLAT, _MODELS_DOTTED),
    "beta": _by_generation(*[("--beta",)] * 3, ("--model.beta",)),
    "n_samples": _by_generation(*[("--n_samples_per_prompt",)] * 3, ("--rollout.n_samples_per_prompt",)),
    "estimator": _by_generation(*[("--advantage_estimator",)] * 3, ("--algo.advantage.estimator",)),
    "temperature": _by_generation(*[("--temperature",)] * 3, ("--rollout.temperature",)),
    "vanilla_loss": _by_generation(("--vanilla_loss",), (), (), ()),
    "micro_batch": _by_generation(*[("--micro_train_batch_size",)] * 3, ()),
}

# What each flag takes: "bool" (store_true, no value), "int", "float" or "str" (anything else).
FLAG_KINDS: dict[str, str] = {
    **dict.fromkeys(
        ("--bf16", "--flash_attn", "--packing_samples", "--ds.packing_samples", "--use_dynamic_batch",
         "--train.dynamic_batch_enable", "--vanilla_loss"),
        "bool",
    ),
    **dict.fromkeys(
        ("--ring_attn_size", "--ds.ring_attn_size", "--n_samples_per_prompt", "--rollout.n_samples_per_prompt",
         "--micro_train_batch_size"),
        "int",
    ),
    **dict.fromkeys(
        ("--max_norm", "--actor.max_norm", "--critic.max_norm", "--beta", "--model.beta", "--temperature",
         "--rollout.temperature"),
        "float",
    ),
}  # fmt: skip


def _parse_abbreviations(table: dict[Generation, dict[str, str]]) -> dict[Generation, dict[str, dict[str, int]]]:
    parsed: dict[Generation, dict[str, dict[str, int]]] = {}
    for generation, entries in table.items():
        parsed[generation] = {}
        for entry, spec in entries.items():
            parsed[generation][entry] = {word.replace("|", ""): word.index("|") for word in spec.split()}
    return parsed


_MIN_PREFIX = _parse_abbreviations(ABBREVIATIONS)


def known_flags(generation: Generation, entry: str) -> dict[str, int]:
    """`{flag: shortest unique prefix length}` of the rule flags that `entry` accepts in `generation` (the union
    of all entry points when this generation has no such entry point, e.g. `train_kto` after v0.9.5)."""
    tables = _MIN_PREFIX[generation]
    return tables.get(entry, tables["*"])


def resolve(name: str, generation: Generation, entry: str) -> str | None:
    """The rule flag that argparse would match for the option `name` (as written, without `=value`), or `None`.

    `name` matches a flag exactly, or as a prefix at least as long as the flag's shortest unique prefix. A shorter
    prefix is ambiguous (argparse refuses it) or is another flag's exact name, so it matches nothing here.

    Example:
        ```python
        >>> resolve("--ds.param", Generation.DOTTED, "train_rm")
        '--ds.param_dtype'
        >>> resolve("--ds.pa", Generation.DOTTED, "train_rm") is None  # also --ds.packing_samples
        True
        ```
    """
    table = known_flags(generation, entry)
    if name in table:
        return name
    for flag, shortest in table.items():
        if len(name) >= shortest and flag.startswith(name):
            return flag
    return None


def flags_for(concern: str, generation: Generation, entry: str) -> tuple[str, ...]:
    """The flags behind `concern` (a key of `CONCERNS`) that `entry` accepts in `generation`."""
    table = known_flags(generation, entry)
    return tuple(flag for flag in CONCERNS[concern][generation] if flag in table)


def flag_kind(flag: str) -> str:
    return FLAG_KINDS.get(flag, "str")


def fits_dotted(name: str) -> bool:
    """Whether an undotted option name can belong to a >= 0.10.2 parser (exactly or as a prefix)."""
    return any(flag.startswith(name) for flag in DOTTED_FLAT_FLAGS)


def generation_for_version(version: str) -> Generation:
    """The flag generation of an OpenRLHF release, e.g. `"0.8.9"` -> `LEGACY`, `"v0.10.1.post2"` -> `PARAM_DTYPE`.

    Raises:
        `ValueError`: `version` is not a version number.
    """
    from packaging.version import InvalidVersion, Version

    try:
        release = (Version(version.strip().lstrip("vV")).release + (0, 0, 0))[:3]
    except InvalidVersion:
        raise ValueError(
            f"`--openrlhf-version {version}` is not a version number. Pass the OpenRLHF release, e.g. `0.8.9` or "
            "`0.11.2`."
        ) from None
    if release < (0, 8, 10):
        return LEGACY
    if release < (0, 9, 2):
        return ATTN_IMPL
    if release < (0, 10, 2):
        return PARAM_DTYPE
    return DOTTED


__all__ = [
    "ATTN_IMPL",
    "CONCERNS",
    "DOTTED",
    "ENTRY_POINTS",
    "GENERATIONS",
    "Generation",
    "LEGACY",
    "PARAM_DTYPE",
    "SERVING",
    "TRAINERS",
    "flag_kind",
    "flags_for",
    "fits_dotted",
    "generation_for_version",
    "known_flags",
    "resolve",
]
