"""verl's actor_rollout_ref.* keys (model, actor, reference model, rollout) in jarl's terms."""

from __future__ import annotations

from jax_agent_rl.compat.verl.keys.rules import (
    ENGINE,
    FSDP,
    LOGPROB,
    VerlKey,
    backend,
    betas,
    fixed,
    kl,
    kl_kind,
    lora_targets,
    max_turns,
    micro_batch,
    mini_batches,
    not_needed,
    parser,
    refuse,
    trace_backend,
    warmup_steps,
)

WORKERS: tuple[VerlKey, ...] = (
    # model
    VerlKey(
        "actor_rollout_ref.model.path",
        "model.path",
        "a local HF checkpoint folder: jarl downloads nothing",
    ),
    VerlKey(
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "learner.remat",
        "recompute activations in the backward pass",
    ),
    VerlKey(
        "actor_rollout_ref.model.use_remove_padding",
        "",
        "not needed: with learner.packing=true (the default) jarl computes on no padding",
        not_needed,
    ),
    VerlKey("actor_rollout_ref.model.enable_activation_offload", "", FSDP, not_needed),
    VerlKey(
        "actor_rollout_ref.model.lora_rank",
        "model.lora.rank",
        "the same (0: no LoRA, every weight trained)",
    ),
    VerlKey(
        "actor_rollout_ref.model.lora_alpha",
        "model.lora.alpha",
        "the same; `alpha / rank` at most 1e4 (larger scales overflow float32 once the "
        "adapters train) and alpha at least 1e-4 (smaller ones round the adapters' "
        "contribution to nothing)",
    ),
    VerlKey(
        "actor_rollout_ref.model.target_modules",
        "model.lora.targets",
        "all-linear -> [q, k, v, o, gate, up, down]; q_proj ... down_proj -> q ... down",
        lora_targets,
    ),
    VerlKey(
        "actor_rollout_ref.model.lora_adapter_path",
        "model.lora.adapter_path",
        "the same: a PEFT adapter folder training starts from (its rank, alpha and targets "
        "taken with model.lora.rank=0, else checked against model.lora's)",
    ),
    VerlKey(
        "actor_rollout_ref.model.use_shm",
        "",
        "not needed: jarl reads the checkpoint from its folder once",
        not_needed,
    ),
    VerlKey(
        "actor_rollout_ref.hybrid_engine",
        "",
        "not needed: the rollout backend decides where it runs (the embedded engine on the "
        "learner's devices, vLLM replicas on engine.vllm.devices)",
        not_needed,
    ),
    # actor
    VerlKey("actor_rollout_ref.actor.optim.lr", "optim.lr", "the same"),
    VerlKey(
        "actor_rollout_ref.actor.optim.weight_decay",
        "optim.weight_decay",
        "the same (verl's default is 0.01, jarl's 0)",
    ),
    VerlKey(
        "actor_rollout_ref.actor.optim.betas", "optim.b1, optim.b2", "[b1, b2] -> b1, b2", betas
    ),
    VerlKey(
        "actor_rollout_ref.actor.optim.lr_warmup_steps",
        "optim.warmup_steps",
        "the same; -1 (verl: use lr_warmup_steps_ratio, 0 by default) -> 0",
        warmup_steps,
    ),
    VerlKey(
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
        "",
        "no equivalent ratio: set optim.warmup_steps, a COUNT of steps (verl's is ratio x total "
        "training steps)",
        refuse,
    ),
    VerlKey(
        "actor_rollout_ref.actor.strategy",
        "",
        "not needed: jarl shards over the mesh (mesh.*)",
        not_needed,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.prompt_length",
        "",
        "no equivalent: jarl reads data.max_prompt_length, which verl copies here by default; "
        "set that",
        refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.response_length",
        "",
        "no equivalent: jarl reads data.max_response_length, which verl copies here by default; "
        "set that",
        refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.agent.num_workers",
        "",
        "not needed: jarl runs every episode as a coroutine in one process "
        "(engine.max_concurrent at once)",
        not_needed,
    ),
    VerlKey("actor_rollout_ref.actor.grad_clip", "optim.grad_clip", "the same"),
    VerlKey(
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "algorithm.mini_batches",
        "a SIZE in prompts (verl multiplies it by group.n); jarl's is a COUNT: "
        "mini_batches = data.prompts_per_step / ppo_mini_batch_size, which must divide",
        mini_batches,
        trap=True,
    ),
    VerlKey(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "learner.micro_batch_size",
        "per device; jarl's is over the data-parallel devices: micro_batch_size = per_gpu x "
        "mesh.data x mesh.fsdp (read when learner.packing=false)",
        micro_batch,
        trap=True,
    ),
    VerlKey(
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "learner.packing",
        "micro-batches by token budget",
    ),
    VerlKey(
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "learner.row_tokens",
        "tokens per device row (learner.packing=true)",
    ),
    VerlKey("actor_rollout_ref.actor.ppo_epochs", "algorithm.ppo_epochs", "the same"),
    VerlKey(
        "actor_rollout_ref.actor.use_kl_loss",
        "algorithm.kl_coef",
        "True: kl_coef = kl_loss_coef (verl's default 0.001); False: 0 (jarl's KL loss is on when "
        "kl_coef > 0)",
        kl,
        trap=True,
    ),
    VerlKey(
        "actor_rollout_ref.actor.kl_loss_coef",
        "algorithm.kl_coef",
        "read with use_kl_loss (alone, verl ignores it)",
        kl,
        trap=True,
    ),
    VerlKey(
        "actor_rollout_ref.actor.kl_loss_type",
        "algorithm.kl_kind",
        "low_var_kl -> k3, kl -> k1, mse -> k2, abs -> abs",
        kl_kind,
    ),
    VerlKey("actor_rollout_ref.actor.entropy_coeff", "algorithm.entropy_coef", "the same"),
    VerlKey(
        "actor_rollout_ref.actor.clip_ratio",
        "",
        "verl's loss reads clip_ratio_low and clip_ratio_high (0.2 each by default), not this: "
        "set algorithm.clip_low and algorithm.clip_high",
        refuse,
        trap=True,
    ),
    VerlKey("actor_rollout_ref.actor.clip_ratio_low", "algorithm.clip_low", "the same"),
    VerlKey("actor_rollout_ref.actor.clip_ratio_high", "algorithm.clip_high", "the same"),
    VerlKey("actor_rollout_ref.actor.clip_ratio_c", "algorithm.clip_c", "the same (dual clip)"),
    VerlKey("actor_rollout_ref.actor.loss_agg_mode", "algorithm.loss_agg_mode", "the same names"),
    VerlKey(
        "actor_rollout_ref.actor.use_torch_compile",
        "",
        "not needed: jarl's steps are always compiled (XLA)",
        not_needed,
    ),
    VerlKey("actor_rollout_ref.actor.fsdp_config.", "", FSDP, not_needed),
    VerlKey(
        "actor_rollout_ref.actor.megatron.",
        "",
        "not needed: jarl shards over the mesh (mesh.*)",
        not_needed,
    ),
    # reference model
    VerlKey("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "", LOGPROB, not_needed),
    VerlKey("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "", LOGPROB, not_needed),
    VerlKey("actor_rollout_ref.ref.fsdp_config.", "", FSDP, not_needed),
    VerlKey(
        "actor_rollout_ref.ref.megatron.",
        "",
        "not needed: jarl shards over the mesh (mesh.*)",
        not_needed,
    ),
    # rollout
    VerlKey(
        "actor_rollout_ref.rollout.name",
        "engine.backend",
        "vllm -> vllm; jarl has no SGLang backend (the embedded JAX engine is its default)",
        backend,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.mode",
        "",
        "async: what jarl always does (one coroutine per episode); not trainer.max_staleness, "
        "which is off-policy training",
        fixed("async"),
    ),
    VerlKey("actor_rollout_ref.rollout.n", "group.n", "samples per prompt"),
    VerlKey("actor_rollout_ref.rollout.temperature", "sampling.temperature", "the same"),
    VerlKey("actor_rollout_ref.rollout.top_p", "sampling.top_p", "the same"),
    VerlKey("actor_rollout_ref.rollout.top_k", "sampling.top_k", "the same (-1: off)"),
    VerlKey(
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "engine.vllm.tensor_parallel_size",
        "the same: GPUs per vLLM engine (the learner's mesh is its own, mesh.*)",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "",
        "no equivalent: jarl sizes the KV cache in GiB, engine.kv_cache_gib (0: enough for "
        "engine.max_concurrent sequences)",
        refuse,
    ),
    VerlKey("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "", LOGPROB, not_needed),
    VerlKey("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "", LOGPROB, not_needed),
    VerlKey(
        "actor_rollout_ref.rollout.multi_stage_wake_up",
        "",
        ENGINE.format("rollout engine"),
        not_needed,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.free_cache_engine",
        "",
        ENGINE.format("rollout engine"),
        not_needed,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.enforce_eager", "", ENGINE.format("rollout engine"), not_needed
    ),
    VerlKey(
        "actor_rollout_ref.rollout.load_format", "", ENGINE.format("rollout engine"), not_needed
    ),
    VerlKey(
        "actor_rollout_ref.rollout.layered_summon", "", ENGINE.format("rollout engine"), not_needed
    ),
    VerlKey(
        "actor_rollout_ref.rollout.sglang_rollout_mode",
        "",
        ENGINE.format("SGLang rollout"),
        not_needed,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.server.",
        "",
        ENGINE.format("SGLang server"),
        not_needed,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.over_sample_rate",
        "",
        "no equivalent: jarl waits for every episode of a step (group.dynamic_sampling refills "
        "groups instead)",
        refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.enable",
        "",
        "not needed: each row's agent_name picks its loop (rows without one: "
        "agent.default_agent_loop)",
        not_needed,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.tool_config_path",
        "tools.config",
        "verl's tool YAML, read as it is",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
        "env.interaction_config",
        "verl's interaction YAML, read as it is",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
        "agent.max_turns",
        "model turns per episode",
        max_turns,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.max_user_turns",
        "",
        "no equivalent: an environment ends its episode itself (agent.max_turns caps model turns)",
        refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls",
        "agent.max_tool_calls_per_turn",
        "tool calls of one turn that run (verl's default 1, jarl's 8); verl drops the turn's "
        "other calls, jarl answers each with an error observation naming the cap. How many "
        "run at once is agent.max_parallel_tool_calls",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length",
        "agent.max_tool_response_tokens",
        "the same",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side",
        "agent.tool_response_truncate",
        "the same names",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.format", "agent.parser", "hermes -> hermes", parser
    ),
    VerlKey(
        "actor_rollout_ref.rollout.agent.default_agent_loop",
        "agent.default_agent_loop",
        "the same names",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.trace.backend",
        "trainer.trace_backend",
        "mlflow -> mlflow",
        trace_backend,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.trace.token2text",
        "",
        "not needed: jarl's traces always hold the text",
        not_needed,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.val_kwargs.n",
        "",
        "1: what jarl's evaluation does (`jarl eval RUN --n N` for pass@N)",
        fixed(1),
    ),
    VerlKey(
        "actor_rollout_ref.rollout.val_kwargs.temperature",
        "",
        "0: what jarl's evaluation does (greedy)",
        fixed(0),
    ),
    VerlKey(
        "actor_rollout_ref.rollout.val_kwargs.top_p",
        "",
        "1.0: what jarl's evaluation does (greedy)",
        fixed(1),
    ),
    VerlKey(
        "actor_rollout_ref.rollout.val_kwargs.do_sample",
        "",
        "False: what jarl's evaluation does (greedy)",
        fixed(False),
    ),
)
