"""Tiny models, a tokenizer and toy datasets, built locally with no network.

Used by `safe-trainers demo`, by the launch scripts when no model or dataset is given, and by the tests. Models are
real transformers architectures (2 layers, hidden size 32) saved with `save_pretrained`, so the trainers load them
through the same `from_pretrained` path as a real checkpoint.
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Literal


from ..kinds import get_kind

if TYPE_CHECKING:
    from datasets import Dataset


Family = Literal["qwen2", "llama", "gemma2", "gemma3"]
FAMILIES: tuple[str, ...] = ("qwen2", "llama", "gemma2", "gemma3")
WORDS = (
    "the a one two three four five six seven eight nine ten is was and or not good bad yes no cat dog sun moon "
    "red blue green big small up down left right what how why who answer question add sum number"
).split()
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
VOCAB_SIZE = 384


def build_tokenizer():
    """A byte-level BPE `PreTrainedTokenizerFast` trained on the toy vocabulary (`<pad>` is distinct from `<eos>`).

    Byte-level BPE is what Qwen2, Llama-3 and most current checkpoints use, so the saved tokenizer reloads correctly
    through `AutoTokenizer.from_pretrained` whatever tokenizer class transformers picks for the model family.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(WORDS)] + [f" {word}" for word in WORDS] + list(WORDS)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for message in messages %}{{ message['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}answer{% endif %}"
    )
    return fast


def model_config(family: str = "qwen2", vocab_size: int = VOCAB_SIZE, **overrides):
    """A 2-layer, hidden-32 config of the given family (`qwen2`, `llama`, `gemma2`, `gemma3`)."""
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig}
    if family not in classes:
        raise ValueError(f"Unknown toy model family {family!r}; choose one of {list(classes)}.")
    if family in ("gemma2", "gemma3"):
        common.update(head_dim=8, sliding_window=64)
    common.update(overrides)
    return classes[family](**common)


def build_model(family: str = "qwen2", task: Literal["causal_lm", "seq_cls"] = "causal_lm", seed: int = 0, **overrides):
    """A randomly initialised tiny model of `family` (fp32) for causal LM or sequence classification (1 label)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = model_config(family, **overrides)
    if task == "seq_cls":
        config.num_labels = 1
        return AutoModelForSequenceClassification.from_config(config)
    return AutoModelForCausalLM.from_config(config)


def save_toy_model(path: str, family: str = "qwen2", task: Literal["causal_lm", "seq_cls"] = "causal_lm", **overrides) -> str:
    """Build a tiny model and its tokenizer and `save_pretrained` both to `path`; return `path`."""
    os.makedirs(path, exist_ok=True)
    build_model(family, task, **overrides).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prompt_completion_dataset(n: int = 32, seed: int = 0) -> Dataset:
    """Prompt-completion data (`prompt`, `completion`) for SFT (TRL trains on the completion tokens only)."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list(
        [{"prompt": _sentence(rng, 4), "completion": " yes good " + _sentence(rng, 3)} for _ in range(n)]
    )


def preference_dataset(n: int = 32, seed: int = 0) -> Dataset:
    """Standard-format preference data (`prompt`, `chosen`, `rejected`) for reward modelling and DPO."""
    rng = random.Random(seed)
    rows = [
        {"prompt": _sentence(rng, 4), "chosen": " yes good " + _sentence(rng, 3), "rejected": " no bad " + _sentence(rng, 3)}
        for _ in range(n)
    ]
    from datasets import Dataset

    return Dataset.from_list(rows)


def unpaired_dataset(n: int = 32, seed: int = 0) -> Dataset:
    """Unpaired preference data (`prompt`, `completion`, `label`) for KTO, alternating desirable/undesirable."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        good = i % 2 == 0
        completion = (" yes good " if good else " no bad ") + _sentence(rng, 3)
        rows.append({"prompt": _sentence(rng, 4), "completion": completion, "label": good})
    from datasets import Dataset

    return Dataset.from_list(rows)


def prompt_dataset(n: int = 16, seed: int = 0) -> Dataset:
    """Prompt-only data (`prompt`) for GRPO and RLOO."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": _sentence(rng, 4)} for _ in range(n)])


DATASET_BUILDERS = {
    "prompt_completion": prompt_completion_dataset,
    "preference": preference_dataset,
    "unpaired": unpaired_dataset,
    "prompt": prompt_dataset,
}


def dataset_for(kind: str, n: int = 32, seed: int = 0) -> Dataset:
    """The toy dataset in the format trainer `kind` expects (its `data_format` in [`~safe_trainers.kinds.KINDS`])."""
    return DATASET_BUILDERS[get_kind(kind).data_format](n, seed)


def count_words_reward(completions, **kwargs) -> list[float]:
    """Toy GRPO reward: +1 per "good"/"yes" word, -1 per "bad"/"no" word in the completion."""
    rewards = []
    for completion in completions:
        text = completion if isinstance(completion, str) else " ".join(m["content"] for m in completion)
        words = text.split()
        rewards.append(float(sum(w in ("good", "yes") for w in words) - sum(w in ("bad", "no") for w in words)))
    return rewards


def rank_reward(completions, **kwargs) -> list[float]:
    """Toy GRPO/RLOO reward that always differs inside a group (0, 1, 2, 3, 0, ...), so every step has non-zero
    advantages."""
    return [float(i % 4) for i in range(len(completions))]
