"""Every upstream name safe_trainers depends on beyond the documented public API (and the public hooks the NaN guard
cannot work without): one [`Touchpoint`] each. Data only.

`docs/design/upstream.md` is generated from this table (`render_markdown`); the names of the rows whose `at_import`
holds are verified when the trainers are imported (`names.py`), and the rows with a `check` are verified while
training (`safe_trainers/trainer/hooks_ran.py`). "since" was read from the released wheels' source (transformers 4.0 to
5.24, TRL 0.16 to 1.16, PEFT 0.17, DeepSpeed 0.18).
"""

from __future__ import annotations

from .touchpoint import Touchpoint as T


HOOKS = "tests/guard/test_upstream_hooks.py"
NAMES = "tests/trainers/test_upstream_names.py"
REPLAY = "tests/guard/test_diagnosis_replay.py::test_the_replay_leaves_the_trainer_as_it_was"

TRAINER = "transformers:Trainer"
ARGS = "transformers:TrainingArguments"
DEVICES = "cli/target.py, rules/apply.py"
NO_DEVICE = "tests/rules/test_no_device_setup.py"
DEVICE_TESTS = (f"{NO_DEVICE}::test_check_sets_up_no_device",
                f"{NO_DEVICE}::test_the_fixed_copy_of_args_sets_up_nothing_new")
TRAINER_HOOKS = "trainer/hooks.py"
CHECKPOINT_HOOKS = "trainer/checkpoints.py"
TRANSFORMERS: tuple[T, ...] = (
    T(TRAINER, "_get_grad_norm", "method", "overrides", "5.3.0", TRAINER_HOOKS,
      "the per-step gradient hook: `NanGuard.end_of_step` closes the step's fault flag there",
      (f"{HOOKS}::test_without_the_grad_norm_hook_the_run_stops_before_its_first_update",
       "tests/guard/test_faults_on_each_trainer.py::test_inf_gradient_is_skipped"), check="pre_optimizer_step"),
    T(TRAINER, "training_step", "method", "overrides", "<=4.0", TRAINER_HOOKS,
      "the loss accumulator: `NanGuard.observe_loss` folds each micro-batch's loss into the step's fault flag",
      (f"{HOOKS}::test_without_the_loss_hook_the_run_stops_before_its_first_update",
       "tests/guard/test_faults_on_each_trainer.py::test_nan_loss_is_skipped"), check="pre_optimizer_step"),
    T(TRAINER, "compute_loss", "method", "overrides, calls", "<=4.0", "trainer/hooks.py, trainer/replay.py",
      "keeps a host copy of each micro-batch and replays it to name the first non-finite module",
      ("tests/guard/test_faulty_micro_batch.py::test_diagnosis_finds_the_faulty_micro_batch",)),
    T(TRAINER, "_tr_loss", "attribute", "reads, writes", "5.3.0", TRAINER_HOOKS,
      "the Trainer's running loss, zeroed after a window with a non-finite loss",
      (f"{HOOKS}::test_a_missing_attribute_or_hook_is_named_by_the_pure_check",
       "tests/guard/test_logged_loss.py::test_logs_report_applied_steps_and_never_rewind"),
      check="pre_optimizer_step"),
    T(TRAINER, "_total_loss_scalar", "attribute", "reads, writes", "<=4.0", TRAINER_HOOKS,
      "the Trainer's total loss behind `train_loss`, kept finite",
      ("tests/guard/test_logged_loss.py::test_logs_report_applied_steps_and_never_rewind",),
      check="pre_optimizer_step"),
    T(TRAINER, "_globalstep_last_logged", "attribute", "reads", "<=4.0", TRAINER_HOOKS,
      "whether the Trainer is about to log its loss window, when the guard closes its own",
      ("tests/guard/test_bookkeeping_contracts.py::test_a_users_own_loss_log_leaves_the_window_alone",),
      check="pre_optimizer_step"),
    T(TRAINER, "_maybe_log_save_evaluate", "method", "overrides", "<=4.0", TRAINER_HOOKS,
      "the log window: closes the guard's loss window as the Trainer logs; verifies the state before a save or an "
      "evaluation",
      (f"{HOOKS}::test_without_the_log_window_hook_the_run_stops_after_its_first_step",
       "tests/guard/test_bookkeeping_contracts.py::test_a_late_callbacks_save_and_eval_see_a_verified_state"),
      check="next_step"),
    T(TRAINER, "_save_checkpoint", "method", "overrides, calls", "<=4.0",
      "trainer/checkpoints.py, trainer/inspection.py",
      "the checkpoint path: verify, write to the staging directory, publish by renaming; its own rotation (run where "
      "it wrote, by `args.save_total_limit`) is kept out of the staging directory by unsetting the limit meanwhile",
      (f"{HOOKS}::test_a_checkpoint_saved_outside_the_staging_path_stops_the_run",
       "tests/guard/test_faults_on_each_trainer.py::test_kill_during_save_leaves_previous_checkpoint_loadable",
       "tests/guard/test_output_dir_links.py::test_the_trainers_own_rotation_never_runs_inside_the_staging_dir"),
      check="save"),
    T(TRAINER, "_get_output_dir", "method", "overrides, calls", "4.21-4.30",
      "trainer/checkpoints.py, trainer/inspection.py",
      "where the Trainer writes a checkpoint: the staging directory while the guard saves",
      (f"{HOOKS}::test_a_checkpoint_saved_outside_the_staging_path_stops_the_run",
       "tests/guard/test_checkpoints_published.py::test_on_save_and_hub_uploads_see_published_checkpoints"),
      check="save", when="saved"),
    T(TRAINER, "_push_from_checkpoint", "method", "overrides, calls", "4.11-4.20", CHECKPOINT_HOOKS,
      "Hub uploads: only of published checkpoints (run-time check: none, it runs only with `push_to_hub`)",
      ("tests/guard/test_checkpoints_published.py::test_on_save_and_hub_uploads_see_published_checkpoints",)),
    T(TRAINER, "_save", "method", "overrides", "<=4.0", CHECKPOINT_HOOKS,
      "`save_model` refuses non-finite weights (run-time check: none, not every backend saves through it)",
      ("tests/guard/test_final_weights_finite.py::test_save_model_refuses_nonfinite_weights",)),
    T(TRAINER, "_save_optimizer_and_scheduler", "method", "overrides, calls", "<=4.40 (not bisected)", CHECKPOINT_HOOKS,
      "background saves: the optimizer's state copied to host memory, `optimizer.pt` written by the writer thread "
      "(run-time check: the staged copy is checked complete and finite before it is published)",
      ("tests/guard/test_background_saves.py::test_stock_trainer_resumes_from_a_checkpoint_written_in_the_background",)),
    T(TRAINER, "_load_optimizer_and_scheduler", "method", "overrides, calls", "<=4.0",
      "trainer/hooks.py, trainer/checkpoint_rollback.py",
      "resume: the backed-off learning rate comes back with the optimizer; rollback from disk reloads it",
      (f"{HOOKS}::test_a_resume_that_bypasses_the_guard_stops_before_its_first_update",
       "tests/guard/test_abort_checkpoint.py::test_abort_checkpoint_holds_the_backed_off_lr_and_resumes"),
      check="pre_optimizer_step", when="resumed"),
    T(TRAINER, "_load_from_checkpoint", "method", "calls", "4.11-4.20", "trainer/checkpoint_rollback.py",
      "rollback from disk (`nan_rollback_from=\"checkpoint\"`) reloads the weights",
      ("tests/guard/test_guard_disk_rollback.py::test_rollback_reloads_the_newest_checkpoint",)),
    T(TRAINER, "_load_best_model", "method", "overrides, calls", "4.11-4.20", "trainer/hooks.py, trainer/inspection.py",
      "weights damaged after the last check are replaced by the best checkpoint (`load_best_model_at_end`); a "
      "snapshot's copies still in flight finish first, on the device",
      ("tests/guard/test_damage_after_the_last_check.py::"
       "test_with_load_best_model_at_end_the_best_checkpoint_is_put_back",)),
    T("transformers:TrainerCallback", "on_pre_optimizer_step", "method", "overrides", "4.41-4.45",
      "trainer/callbacks.py, trainer/hooks_ran.py",
      "the event before `optimizer.step()`, where the guard hands the step's fault flag to the optimizer: the skip",
      (f"{HOOKS}::test_without_the_pre_optimizer_event_the_run_stops_at_its_first_step",
       "tests/guard/test_faults_on_each_trainer.py::test_nan_loss_is_skipped"), check="step_end"),
    T(TRAINER, "get_batch_samples", "method", "overrides", "4.46-4.47", TRAINER_HOOKS,
      "no step past `max_steps`: a run resumed from the checkpoint of its last step fetches no batch",
      ("tests/restarts/test_cluster_launches.py::test_resuming_from_the_final_checkpoint_trains_no_step",)),
    T("transformers.integrations.deepspeed", "deepspeed_load_checkpoint", "function", "imports", "4.32-4.33",
      "trainer/checkpoint_rollback.py", "rollback from disk under DeepSpeed",
      ("tests/guard/test_guard_disk_rollback.py::test_two_ranks_roll_back_to_the_same_checkpoint",)),
    T("transformers.integrations.deepspeed", "unset_hf_deepspeed_config", "function", "calls", "4.32-4.33",
      "scripts/pipeline.py", "builds the embedded toy model outside ZeRO-3's `zero.Init`",
      ("tests/scripts/test_launch.py::test_deepspeed_zero3_dpo_embedded_default",)),
    T("transformers.integrations.deepspeed", "_hf_deepspeed_config_weak_ref", "variable", "reads, writes",
      "4.32-4.33", "scripts/pipeline.py", "restores the ZeRO-3 config after building the toy model",
      ("tests/scripts/test_launch.py::test_deepspeed_zero3_dpo_embedded_default",)),
    T("transformers:PretrainedConfig", "_attn_implementation", "attribute", "reads", "4.36.0",
      "rules/attention.py, cli/demo_run.py", "the attention kernel a model instance was loaded with",
      ("tests/rules/test_attention_rules.py::test_attention_rule_on_instances_and_ref_model",)),
    T("transformers:PretrainedConfig", "_name_or_path", "attribute", "reads", "<=4.0", "rules/context.py",
      "the name (and tokenizer) of a model passed as an instance",
      ("tests/trainers/test_dropin.py::test_grpo_model_instance",)),
    T(ARGS, "_setup_devices", "attribute", "overrides, reads, writes", "<=4.0", DEVICES,
      "the config's cached device (a `cached_property`; the device itself since 4.2-4.5): `safe-trainers check` "
      "replaces it to set up no device, the rules' fixed copy of `args` shares the cached one (without the three "
      "device names the copy sets its devices up again, as transformers does)",
      (*DEVICE_TESTS, f"{NO_DEVICE}::test_without_one_of_transformers_device_names_the_copy_sets_up_its_own")),
    T(ARGS, "distributed_state", "attribute", "overrides, reads, writes", "4.28-4.29", DEVICES,
      "accelerate's `PartialState` the cached device recorded: `None` for `check` (one process of the launch), "
      "shared by the fixed copy", DEVICE_TESTS),
    T(ARGS, "_n_gpu", "attribute", "writes, reads", "4.1-4.2", DEVICES,
      "the GPU count the cached device recorded: set by `check`'s device, shared by the fixed copy", DEVICE_TESTS),
)

GENERATION = "trainer/generation.py"
ROLLOUTS = "tests/guard/test_grpo_rollouts_after_rollback.py"
GRPO_TESTS = {
    "_generate_and_score_completions": (
        f"{HOOKS}::test_without_a_generation_hook_grpo_and_rloo_stop_before_their_first_update",
        f"{ROLLOUTS}::test_grpo_never_samples_from_a_damaged_policy",
    ),
    "_calculate_rewards": (
        f"{HOOKS}::test_without_a_generation_hook_grpo_and_rloo_stop_before_their_first_update",
        "tests/guard/test_faults_on_each_trainer.py::test_grpo_nonfinite_rewards",
        "tests/guard/test_guard_rloo.py::test_rloo_nonfinite_rewards",
    ),
    "_buffered_inputs": (
        f"{ROLLOUTS}::test_grpo_rollback_discards_rollouts_of_the_discarded_policy",
        "tests/guard/test_guard_rloo.py::test_rloo_discard_rollouts_regenerates_from_the_current_policy",
    ),
    "_last_loaded_step": (f"{ROLLOUTS}::test_discard_rollouts_forces_a_vllm_weight_sync",),
}


def _online(owner: str, since: str, rewards_since: str) -> tuple[T, ...]:
    """The four names GRPO's and RLOO's generation hooks touch."""
    return (
        T(owner, "_generate_and_score_completions", "method", "overrides", since, GENERATION,
          "verifies the weights before each generation, rolling back a damaged policy before it samples",
          GRPO_TESTS["_generate_and_score_completions"], check="pre_optimizer_step"),
        T(owner, "_calculate_rewards", "method", "overrides", rewards_since, GENERATION,
          "records non-finite rewards as `reward` events",
          GRPO_TESTS["_calculate_rewards"], check="pre_optimizer_step"),
        T(owner, "_buffered_inputs", "attribute", "writes", since, GENERATION,
          "the buffered rollouts, discarded after a rollback", GRPO_TESTS["_buffered_inputs"],
          check="pre_optimizer_step"),
        T(owner, "_last_loaded_step", "attribute", "writes", since, GENERATION,
          "forces a weight sync to vLLM after a rollback", GRPO_TESTS["_last_loaded_step"],
          check="pre_optimizer_step", when="vllm"),
    )


TRL: tuple[T, ...] = (
    *_online("trl:GRPOTrainer", "<=0.16", rewards_since="0.19"),
    *_online("trl:RLOOTrainer", "0.21-0.24", rewards_since="0.21-0.24"),
    T("trl:*Trainer", "_metrics", "attribute", "reads, writes", "1.8.0 (all six)",
      "trainer/replay.py, collapse/watch.py",
      "TRL's logged metrics, put back after the diagnosis replay; GRPO's and RLOO's read each step by the collapse "
      "watch (`entropy`, `reward_std`, `frac_reward_zero_std`, `kl`, `completions/mean_length`, `reward`)",
      (REPLAY, "tests/guard/test_bookkeeping_contracts.py::test_diagnosis_replay_does_not_count_in_trl_metrics",
       "tests/collapse/test_collapse_runs.py::test_a_reward_turning_constant_is_reported_within_10_steps")),
    T("trl:*Trainer", "_total_train_tokens", "attribute", "reads, writes", "1.8.0 (all six)", "trainer/replay.py",
      "TRL's token counter (`num_tokens`), put back after the diagnosis replay",
      (REPLAY, "tests/guard/test_bookkeeping_contracts.py::test_diagnosis_replay_does_not_count_in_trl_metrics")),
    *(
        T("trl:GRPOTrainer", name, "attribute", "reads, writes", "1.8.0", "trainer/replay.py",
          f"the adaptive entropy controller's {what}, put back after the diagnosis replay", (REPLAY,))
        for name, what in (
            ("entropy_coef", "coefficient"),
            ("_last_world_entropy", "last measured entropy"),
            ("_entropy_window_stats", "window sums"),
        )
    ),
    T("trl.trainer.utils", "get_config_model_id", "function", "imports", "0.25-0.26", "trainer/mixin.py",
      "names the default output directory after the model, as TRL does",
      ("tests/trainers/test_trainers.py::test_args_none_default_config_named_after_model",)),
)

ZERO_TEST = "tests/guard/test_guard_distributed.py::test_deepspeed_zero_fault_on_one_rank"
PLANTED_TEST = ("tests/restarts/test_planted_checkpoints_distributed.py::"
                "test_a_real_checkpoint_is_accepted_and_a_planted_one_runs_nothing")
COMPILE_TEST = "tests/restarts/test_watchdog_spares_working_runs.py::test_a_step_that_compiles_past_the_bound_finishes"
OTHERS: tuple[T, ...] = (
    T("torch", "_foreach_norm", "function", "calls", "<=2.13 (not bisected)", "runtime/finite.py",
      "one fused finiteness check over many tensors",
      ("tests/guard/test_faults_on_each_trainer.py::test_nan_weight_rolls_back",)),
    T("torch.optim:Optimizer", "_step_supports_amp_scaling", "attribute", "reads", "<=2.13 (not bisected)",
      "guard/step/skip.py", "fused optimizers skip a faulty step on the device (no host sync)",
      ("tests/guard/test_faults_on_each_trainer.py::test_nan_loss_is_skipped",)),
    T("torch.optim:Optimizer", "found_inf", "attribute", "writes", "<=2.13 (not bisected)", "guard/step/skip.py",
      "the device flag a fused optimizer reads to skip its step, removed after the step",
      ("tests/guard/test_faults_on_each_trainer.py::test_nan_loss_is_skipped",
       "tests/guard/test_guard_loss_scaler.py::test_the_fused_optimizers_found_inf_is_removed_after_the_step")),
    T("torch.amp:GradScaler", "_per_optimizer_states", "attribute", "reads", "<=2.13 (not bisected)",
      "guard/step/skip.py",
      "whether the fp16 scaler has unscaled this step's gradients yet, before the fault is folded in",
      ("tests/guard/test_guard_loss_scaler.py::test_a_step_whose_gradients_were_not_unscaled_yet_is_checked_first",)),
    T("torch.amp:GradScaler", "_found_inf_per_device", "method", "calls", "<=2.13 (not bisected)",
      "guard/step/skip.py",
      "the fp16 scaler's own `found_inf`, into which the guard folds a faulted step (no host sync)",
      ("tests/guard/test_guard_loss_scaler.py::test_a_faulted_step_is_skipped_through_the_scalers_found_inf",
       "tests/guard/test_guard_loss_scaler.py::test_without_the_guard_a_poisoned_step_crashes_the_scaler")),
    T("torch.optim.lr_scheduler:LRScheduler", "_last_lr", "attribute", "writes", "<=2.13 (not bisected)",
      "guard/rollback/actions.py", "the reported learning rate after a backoff",
      ("tests/guard/test_faults_on_each_trainer.py::test_nan_weight_rolls_back",)),
    *(
        T(owner, name, kind, uses, "<=2.13 (not bisected)", "restarts/compile_watch.py",
          f"TorchDynamo's compile hooks: {purpose}", (COMPILE_TEST,))
        for owner, name, kind, uses, purpose in (
            ("torch", "_dynamo", "variable", "imports", "the module of the compile hooks (`torch._dynamo.callback`)"),
            ("torch._dynamo.callback", "callback_handler", "variable", "reads",
             "the handler that runs callbacks when a compilation starts and ends"),
            ("torch._dynamo.callback:CompilationCallbackHandler", "register_start_callback", "method", "calls",
             "the hang watchdog stops the step's clock while torch compiles"),
            ("torch._dynamo.callback:CompilationCallbackHandler", "register_end_callback", "method", "calls",
             "the clock goes on when the compilation ends"),
            ("torch._dynamo.callback:CompilationCallbackHandler", "remove_start_callback", "method", "calls",
             "the hooks are removed when `train()` ends"),
            ("torch._dynamo.callback:CompilationCallbackHandler", "remove_end_callback", "method", "calls",
             "the hooks are removed when `train()` ends"),
        )
    ),
    *(
        T(owner, name, "variable", "allows", "<=2.13 (not bisected)", "restarts/pickled_state.py",
          f"a name DCP stores in an FSDP2 checkpoint's `.metadata` ({purpose}), allowed by the resume's safe unpickler",
          (PLANTED_TEST,))
        for owner, name, purpose in (
            ("torch.serialization", "_get_layout", "tensor layouts"),
        )
    ),
    T("torch.distributed.distributed_c10d", "_get_default_store", "function", "calls", "<=2.13 (not bisected)",
      "restarts/compile_peers.py",
      "the process group's key-value store, where each rank says that it compiles (a rank waiting for it is not hung)",
      ("tests/restarts/test_watchdog_spares_working_runs.py::"
       "test_a_rank_that_waits_for_another_ranks_compile_is_not_hung",)),
    T("peft.utils.other", "set_additional_trainable_modules", "function", "imports", "<=0.17.0", "rules/peft.py",
      "trains and saves a LoRA reward model's head (`peft.reward_seq_cls_lora`)",
      ("tests/rules/test_peft_rules.py::test_reward_peft_model_with_frozen_head_gets_a_trained_and_saved_head",)),
    *(
        T(f"deepspeed.runtime.zero.{module}", name, kind, uses, "<=0.18.0", where, f"ZeRO-{stages}: {purpose}",
          (ZERO_TEST,))
        for module, name, kind, uses, where, stages, purpose in (
            ("stage3:DeepSpeedZeroOptimizer_Stage3", "fp32_partitioned_groups_flat", "attribute", "reads",
             "runtime/finite.py", "3", "the fp32 master partition, verified finite"),
            ("stage3:DeepSpeedZeroOptimizer_Stage3", "fp16_partitioned_groups_flat", "attribute", "reads",
             "runtime/finite.py", "3", "the 16-bit partition, verified finite"),
            ("stage3:DeepSpeedZeroOptimizer_Stage3", "persistent_parameters", "attribute", "reads",
             "runtime/finite.py", "3", "parameters kept whole on every rank, verified finite"),
            ("stage_1_and_2:DeepSpeedZeroOptimizer", "single_partition_of_fp32_groups", "attribute", "reads, writes",
             "runtime/finite.py, guard/rollback/memory.py", "1/2", "the fp32 master partition, verified and restored"),
            ("stage_1_and_2:DeepSpeedZeroOptimizer", "bit16_groups_flat", "attribute", "reads",
             "runtime/finite.py", "1/2", "the 16-bit partition, verified finite"),
            ("stage_1_and_2:DeepSpeedZeroOptimizer", "update_lp_params", "method", "calls", "guard/rollback/memory.py",
             "1/2", "copies the restored master weights to the 16-bit ones"),
            ("stage3:DeepSpeedZeroOptimizer_Stage3", "checkpoint_event_prologue", "method", "calls",
             "guard/rollback/memory.py", "3", "brackets the restore of a snapshot"),
            ("stage3:DeepSpeedZeroOptimizer_Stage3", "checkpoint_event_epilogue", "method", "calls",
             "guard/rollback/memory.py", "3", "brackets the restore of a snapshot"),
        )
    ),
)

TOUCHPOINTS: tuple[T, ...] = TRANSFORMERS + TRL + OTHERS

__all__ = ["TOUCHPOINTS"]
