"""Token rules: a reward model's padding must not be its EOS token, and the embedding rows of the chat template's
special tokens must be trained (not near zero)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .report import Change, Finding
from .base import BuiltTrainer, Rule

if TYPE_CHECKING:
    import torch


PAD_LIKE = re.compile(r"pad", re.IGNORECASE)
MEDIA = re.compile(r"vision|image|video|audio", re.IGNORECASE)  # `<|vision_pad|>` pads image features in the text
# A row whose norm is below this fraction of the median row norm was never trained (Unsloth `fix_untrained_tokens`).
UNTRAINED_NORM_RATIO = 1e-3
NORM_SAMPLE_ROWS = 4096


def text_tokenizer(processing_class):
    """The tokenizer of a processing class (a processor's `.tokenizer`, or the tokenizer itself)."""
    return getattr(processing_class, "tokenizer", None) or processing_class


def special_tokens(tokenizer) -> dict[int, str]:
    """`{id: text}` of the tokenizer's special and added tokens."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): str(getattr(t, "content", t)) for i, t in decoder.items()}


def pad_candidates(tokenizer) -> list[str]:
    """Tokens that can pad a reward model's sequences instead of EOS: the unknown token (byte-level tokenizers never
    emit it) and special tokens named like a pad token, excluding EOS, BOS and media placeholders."""
    taken = {tokenizer.eos_token, tokenizer.bos_token, None}
    named = [t for t in special_tokens(tokenizer).values() if PAD_LIKE.search(t) and not MEDIA.search(t)]
    vocab = tokenizer.get_vocab()
    return [t for t in dict.fromkeys([tokenizer.unk_token, *named]) if t not in taken and t in vocab]


class RewardPadToken(Rule):
    """Reward models whose pad token is EOS (or missing, so TRL pads with EOS) get a distinct pad token.

    What it changes:
        a pad token equal to EOS, or none (TRL then pads with EOS), becomes a token that never occurs in text (`unk`,
        or a special token named like a pad token) through `pad_token`; warned when there is none.

    Why:
        the sequence-classification head reads the score at the last non-pad token, so the EOS TRL appends counts as
        padding and the score is read one token early
        ([transformers#35909](https://github.com/huggingface/transformers/issues/35909))

    Opt out:
        `safety_disable_rules=["tokens.reward_pad_token"]`.
    """

    id = "tokens.reward_pad_token"
    summary = "Reward models whose pad token is EOS (or missing, so TRL pads with EOS) get a distinct pad token."
    trainers = frozenset({"reward"})
    rationale = "https://github.com/huggingface/transformers/issues/35909"

    def check(self, setup) -> Finding | None:
        if setup.tokenizer is None:
            return None
        tokenizer = text_tokenizer(setup.tokenizer)
        args = setup.args
        eos = getattr(args, "eos_token", None) or tokenizer.eos_token
        pad = getattr(args, "pad_token", None) or tokenizer.pad_token
        if eos is None or (pad is not None and pad != eos):
            return None
        how = (
            f"the tokenizer has no pad token, so TRL pads with the EOS token {eos!r}"
            if pad is None
            else f"the pad token is the EOS token {eos!r}"
        )
        why = (
            "A sequence-classification model reads the reward at the last token that is not padding, and TRL ends "
            "every chosen and rejected text with EOS: that EOS then counts as padding, so the reward is read one "
            "token early, at a position that does not summarise the answer (and a batch with no pad id fails)."
        )
        candidates = pad_candidates(tokenizer)
        if not candidates:
            return self.warned(
                f"{how}. {why} The tokenizer has no unused token to pad with: add one (e.g. `<|pad|>`, then resize "
                "the embeddings) and set `pad_token`."
            )
        return self.fixed(
            f"{how}. {why} Padding with {candidates[0]!r}, which never occurs in text.",
            Change("args.pad_token", getattr(args, "pad_token", None), candidates[0]),
        )


def template_token_ids(tokenizer) -> dict[int, str]:
    """`{id: text}` of the special tokens the chat template writes, plus EOS (TRL appends it to completions)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    text = " ".join(template.values()) if isinstance(template, dict) else str(template)
    ids = {i: t for i, t in special_tokens(tokenizer).items() if t and t in text}
    if tokenizer.eos_token_id is not None:
        ids[int(tokenizer.eos_token_id)] = tokenizer.eos_token
    return dict(sorted(ids.items()))


def near_zero_rows(weight: torch.Tensor, ids: list[int], ratio: float = UNTRAINED_NORM_RATIO) -> list[int]:
    """The `ids` whose rows of an embedding matrix have a norm below `ratio` times the median row norm."""
    if weight.dim() != 2 or weight.shape[0] == 0:
        return []  # e.g. a ZeRO-3 partitioned weight: nothing to read on this rank
    ids = [i for i in ids if 0 <= i < weight.shape[0]]
    if not ids:
        return []
    import torch

    with torch.no_grad():
        step = max(1, weight.shape[0] // NORM_SAMPLE_ROWS)
        reference = weight[::step].float().norm(dim=1).median()
        if not torch.isfinite(reference) or reference <= 0:
            return []
        norms = weight[ids].float().norm(dim=1)
    return [i for i, norm in zip(ids, norms.tolist()) if norm <= ratio * float(reference)]


def embedding_matrices(model) -> dict[str, torch.Tensor]:
    """`{"input": ..., "output": ...}` embedding weights; the output one only when it is not tied to the input."""
    import torch

    matrices = {"input": model.get_input_embeddings().weight}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(output, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.data_ptr() != matrices["input"].data_ptr():
        matrices["output"] = weight
    return matrices


def set_rows_to_mean(weight: torch.Tensor, rows: list[int], ratio: float = UNTRAINED_NORM_RATIO) -> None:
    """Set `rows` of an embedding matrix to the mean of its trained rows (those not near zero). An action."""
    import torch

    with torch.no_grad():
        norms = weight.float().norm(dim=1)
        trained = norms > ratio * norms.median()
        weight[rows] = weight[trained].float().mean(dim=0).to(weight.dtype)


def peft_trains_rows(peft_config, ids: list[int]) -> bool:
    """Whether a PEFT config trains the given embedding rows: the whole embedding (or output) matrices through
    `modules_to_save`, or those rows through `trainable_token_indices`."""
    saved = set(getattr(peft_config, "modules_to_save", None) or [])
    if saved & {"embed_tokens", "lm_head", "wte", "embed_in", "embed_out"}:
        return True
    indices = getattr(peft_config, "trainable_token_indices", None)
    if isinstance(indices, dict):
        indices = [i for rows in indices.values() for i in rows]
    return bool(indices) and set(ids) <= set(indices)


class UntrainedEmbeddings(Rule):
    """Chat-template special tokens with untrained (near-zero) embedding rows are set to the mean (LoRA: warned).

    What it changes:
        *(built)* special tokens that the chat template writes (and the EOS TRL appends) whose input or output
        embedding rows are near zero (< 1e-3 of the median row norm) are set to the mean of the trained rows, in the
        reference model too; warned under LoRA (frozen embeddings), with the `trainable_token_indices` to train them.

    Why:
        never-trained rows (e.g. a base model's chat tokens) start the hidden state at zero: huge gradients through the
        first normalisation, inf grad norm in half precision (Unsloth `fix_untrained_tokens`, NeMo-RL)

    Opt out:
        `safety_disable_rules=["tokens.untrained_embeddings"]`.
    """

    id = "tokens.untrained_embeddings"
    summary = "Chat-template special tokens with untrained (near-zero) embedding rows are set to the mean (LoRA: warned)."
    rationale = "https://github.com/unslothai/unsloth-zoo/blob/main/unsloth_zoo/tokenizer_utils.py"

    def check_built(self, built: BuiltTrainer) -> Finding | None:
        if built.processing_class is None or not hasattr(built.model, "get_input_embeddings"):
            return None
        tokenizer = text_tokenizer(built.processing_class)
        candidates = template_token_ids(tokenizer)
        rows = {name: near_zero_rows(w, list(candidates)) for name, w in embedding_matrices(built.model).items()}
        rows = {name: ids for name, ids in rows.items() if ids}
        if not rows:
            return None
        ids = sorted({i for ids in rows.values() for i in ids})
        shown = ", ".join(f"`{candidates[i]}` ({i})" for i in ids[:5]) + (" ..." if len(ids) > 5 else "")
        where = " and ".join(f"{name} embeddings" for name in rows)
        what = (
            f"{len(ids)} special token(s) the chat template or TRL writes have near-zero {where} (never trained, "
            f"e.g. a base model's chat tokens): {shown}. Their hidden states start at zero, which gives huge "
            "gradients through the first normalisation (inf grad norm in half precision)"
        )
        if built.peft_config is not None:
            if peft_trains_rows(built.peft_config, ids):
                return None  # the adapter trains those rows (`trainable_token_indices` or whole embeddings)
            return self.warned(
                f"{what}, and LoRA keeps the embeddings frozen. Train those rows (`trainable_token_indices="
                f"{ids}` in the `peft_config`), or use the instruct checkpoint the template belongs to."
            )
        return self.fixed(
            f"{what}. Set them to the mean of the trained rows (in the reference model too), as Unsloth does.",
            Change("model.embeddings.untrained_rows", ids, "mean of the trained rows"),
            rows=rows,
        )

    def apply_built(self, trainer, finding: Finding) -> None:
        # The reference model starts as a copy of the policy: give it the same rows, so the KL term starts at 0.
        for model in (trainer.model, getattr(trainer, "ref_model", None)):
            if model is not None:
                matrices = embedding_matrices(model)
                for name, rows in finding.data["rows"].items():
                    if name in matrices:
                        set_rows_to_mean(matrices[name], rows)
