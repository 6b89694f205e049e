"""verl's algorithm, reward, critic and trainer keys in jarl's terms."""

from __future__ import annotations

from jax_agent_rl.compat.verl.keys.rules import (
    VerlKey,
    devices,
    epochs,
    eval_every,
    fixed,
    logger,
    not_needed,
    refills,
    refuse,
    resume,
    reward,
    run_dir,
    save_every,
    steps,
)

TRAINING: tuple[VerlKey, ...] = (
    # algorithm
    VerlKey(
        "algorithm.adv_estimator",
        "algorithm.adv_estimator",
        "the same key: grpo, gae (PPO, adds a critic); verl's others have no equivalent",
    ),
    VerlKey("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std", "the same"),
    VerlKey(
        "algorithm.filter_groups.enable",
        "group.dynamic_sampling",
        "the same (DAPO: drop groups whose rewards are all equal, refill)",
    ),
    VerlKey(
        "algorithm.filter_groups.metric",
        "",
        "acc, score, seq_reward, seq_final_reward: jarl compares a group's rewards (for 0/1 "
        "rules the same groups as acc)",
        fixed("acc", "score", "seq_reward", "seq_final_reward"),
    ),
    VerlKey(
        "algorithm.filter_groups.max_num_gen_batches",
        "group.max_refills",
        "max_refills = max_num_gen_batches - 1 (verl counts the first batch); verl's 0 "
        "(unbounded) has no equivalent",
        refills,
        trap=True,
    ),
    VerlKey(
        "data.gen_batch_size",
        "",
        "no equivalent: jarl rolls out data.prompts_per_step prompts and refills dropped groups "
        "with fresh ones (group.max_refills)",
        refuse,
    ),
    VerlKey("algorithm.gamma", "algorithm.gamma", "the same key"),
    VerlKey("algorithm.lam", "algorithm.lam", "the same key"),
    VerlKey(
        "algorithm.use_kl_in_reward",
        "",
        "False: what jarl always does (its KL is in the loss: algorithm.kl_coef)",
        fixed(False),
    ),
    VerlKey(
        "algorithm.kl_ctrl.kl_coef",
        "",
        "no equivalent: jarl has no KL in the reward; its KL is in the loss, algorithm.kl_coef",
        refuse,
    ),
    VerlKey(
        "algorithm.kl_penalty",
        "",
        "no equivalent: jarl has no KL in the reward; its KL is in the loss, algorithm.kl_kind",
        refuse,
    ),
    # reward
    VerlKey("custom_reward_function.path", "data.reward", "data.reward = path:name", reward),
    VerlKey(
        "custom_reward_function.name",
        "data.reward",
        "data.reward = path:name (name alone: verl's compute_score)",
        reward,
    ),
    VerlKey(
        "custom_reward_function.reward_kwargs.",
        "",
        "no equivalent: jarl calls data.reward's function without extra keyword arguments: "
        "give them defaults in the function",
        refuse,
    ),
    VerlKey(
        "reward_model.enable",
        "",
        "False: what jarl always does (no scalar reward model; a model as the reward is "
        "data.reward=judge, data.judge.*)",
        fixed(False),
    ),
    VerlKey(
        "reward_model.reward_manager",
        "",
        "naive: what jarl does (data.reward scores each episode)",
        fixed("naive"),
    ),
    VerlKey(
        "reward_model.",
        "",
        "no equivalent: jarl has no scalar reward model; a model as the reward is "
        "data.reward=judge (data.judge.*)",
        refuse,
    ),
    # critic
    VerlKey("critic.optim.lr", "optim.critic_lr", "the same"),
    VerlKey(
        "critic.ppo_max_token_len_per_gpu",
        "",
        "not needed: the critic uses the learner's layout (learner.row_tokens)",
        not_needed,
    ),
    VerlKey(
        "critic.forward_max_token_len_per_gpu",
        "",
        "not needed: the critic uses the learner's layout (learner.row_tokens)",
        not_needed,
    ),
    # trainer
    VerlKey("trainer.total_training_steps", "trainer.steps", "the same", steps),
    VerlKey(
        "trainer.total_epochs",
        "trainer.steps",
        "steps = total_epochs x (rows of data.train // data.prompts_per_step), as verl counts "
        "them; ignored when trainer.total_training_steps is set, as in verl",
        epochs,
        trap=True,
    ),
    VerlKey(
        "trainer.n_gpus_per_node",
        "mesh.fsdp",
        "mesh.fsdp = n_gpus_per_node x nnodes / (mesh.tensor x mesh.data)",
        devices,
        trap=True,
    ),
    VerlKey(
        "trainer.nnodes",
        "mesh.fsdp",
        "as n_gpus_per_node; start each host with `jarl train --num-processes`",
        devices,
        trap=True,
    ),
    VerlKey(
        "trainer.project_name",
        "trainer.run_dir",
        "run_dir = runs/project_name/experiment_name",
        run_dir,
    ),
    VerlKey(
        "trainer.experiment_name",
        "trainer.run_dir",
        "run_dir = runs/project_name/experiment_name",
        run_dir,
    ),
    VerlKey(
        "trainer.default_local_dir",
        "trainer.run_dir",
        "the run folder (checkpoints, logs, traces)",
        run_dir,
    ),
    VerlKey(
        "trainer.logger",
        "trainer.tensorboard",
        "console and tensorboard; no wandb/mlflow/swanlab metrics",
        logger,
    ),
    VerlKey(
        "trainer.save_freq",
        "trainer.save_every",
        "the same; -1 (never): jarl always saves at the end, so save_every = trainer.steps",
        save_every,
    ),
    VerlKey(
        "trainer.test_freq",
        "trainer.eval_every",
        "the same; -1: 0 (jarl evaluates at the start and end only)",
        eval_every,
    ),
    VerlKey(
        "trainer.val_before_train",
        "",
        "True: what jarl always does when data.val is set",
        fixed(True),
    ),
    VerlKey(
        "trainer.critic_warmup", "", "0: what jarl always does (no critic-only steps)", fixed(0)
    ),
    VerlKey("trainer.resume_mode", "trainer.resume", "auto -> true, disable -> false", resume),
    VerlKey("trainer.max_actor_ckpt_to_keep", "trainer.keep_checkpoints", "the same"),
    VerlKey(
        "trainer.device",
        "",
        "not needed: JAX uses the accelerator it finds (JAX_PLATFORMS=cpu to force the CPU)",
        not_needed,
    ),
    VerlKey(
        "trainer.balance_batch",
        "",
        "not needed: jarl packs episodes into rows of learner.row_tokens (learner.packing)",
        not_needed,
    ),
    VerlKey(
        "data.seed",
        "",
        "no equivalent: jarl's data order comes from trainer.seed",
        refuse,
    ),
    VerlKey(
        "trainer.log_val_generations",
        "",
        "no equivalent: jarl writes trainer.traces_per_step training episodes a step (`jarl "
        "traces`) and every evaluation's answers (`jarl eval`)",
        refuse,
    ),
    VerlKey("global_profiler.", "", "no equivalent: profile with jax.profiler", refuse),
    VerlKey("ray_kwargs.", "", "not needed: jarl's Ray settings are engine.ray.*", not_needed),
    VerlKey("ray_init.", "", "not needed: jarl's Ray settings are engine.ray.*", not_needed),
    VerlKey(
        "hydra.",
        "",
        "not needed: jarl has no Hydra (its run folder is trainer.run_dir)",
        not_needed,
    ),
)
