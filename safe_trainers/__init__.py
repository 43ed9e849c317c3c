"""safe_trainers: TRL trainers that refuse unsafe settings and never let a NaN reach the weights.

Change one import line, `from trl import DPOTrainer` -> `from safe_trainers import DPOTrainer`.
"""

from .arguments import SafetyArguments
from .configs import DPOConfig, GRPOConfig, KTOConfig, RewardConfig, RLOOConfig, SFTConfig
from .errors import SafetyError, TrainingDivergedError
from .report import Change, Finding, SafetyReport
from .rules import DEFAULT_RULES, Rule, rule_ids
from .trainers import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer


__version__ = "0.1.0"

__all__ = [
    "DEFAULT_RULES",
    "Change",
    "DPOConfig",
    "DPOTrainer",
    "Finding",
    "GRPOConfig",
    "GRPOTrainer",
    "KTOConfig",
    "KTOTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "Rule",
    "SFTConfig",
    "SFTTrainer",
    "SafetyArguments",
    "SafetyError",
    "SafetyReport",
    "TrainingDivergedError",
    "rule_ids",
]
