"""verl's data.* keys (the prompt files, lengths and batch size) in jarl's terms."""

from __future__ import annotations

from jax_agent_rl.compat.verl.keys.rules import (
    VerlKey,
    data_file,
    fixed,
    not_needed,
    prompt_length,
    refuse,
    response_length,
)

DATA: tuple[VerlKey, ...] = (
    # data
    VerlKey("data.train_files", "data.train", "a path, or a list of one", data_file("data.train")),
    VerlKey("data.val_files", "data.val", "a path, or a list of one", data_file("data.val")),
    VerlKey(
        "data.train_batch_size", "data.prompts_per_step", "prompts per step (both count prompts)"
    ),
    VerlKey(
        "data.max_response_length",
        "agent.max_response_tokens, agent.max_tokens_per_turn",
        "model and tool tokens after the prompt; verl has no per-turn cap (a turn may use it "
        "all): the same per-turn cap unless agent.max_tokens_per_turn is given; with an "
        "interaction it must be (else the first turn may leave the interaction none)",
        response_length,
        trap=True,
    ),
    VerlKey(
        "data.max_prompt_length",
        "engine.max_model_len",
        "max_model_len = max_prompt_length + agent.max_response_tokens",
        prompt_length,
        trap=True,
    ),
    VerlKey(
        "data.return_raw_chat",
        "",
        "True: what jarl always does (it renders the chat itself)",
        fixed(True),
    ),
    VerlKey(
        "data.filter_overlong_prompts",
        "",
        "no equivalent: jarl keeps every prompt (filter the file beforehand; see data.truncation)",
        refuse,
    ),
    VerlKey(
        "data.truncation",
        "",
        "no equivalent: jarl never truncates a prompt; `jarl train` refuses a file whose first "
        "rows leave no room in engine.max_model_len, and a later such prompt ends its episode "
        "at once (stop reason max_model_len)",
        refuse,
    ),
    VerlKey(
        "data.shuffle",
        "",
        "True: what jarl always does (a fresh order each epoch, from trainer.seed; a step whose"
        " prompts run past an epoch's end may draw a row twice: the second draw is its own"
        " group, its episodes named `<uid>~1/...`, with their own tool state and seeds)",
        fixed(True),
    ),
    VerlKey(
        "data.dataloader_num_workers",
        "",
        "not needed: jarl reads the rows once, in-process",
        not_needed,
    ),
    VerlKey(
        "data.sampler.class_path",
        "",
        "no equivalent: jarl samples uniformly, a fresh order each epoch",
        refuse,
    ),
    VerlKey(
        "data.sampler.class_name",
        "",
        "no equivalent: jarl samples uniformly, a fresh order each epoch",
        refuse,
    ),
    VerlKey(
        "data.custom_cls.path",
        "",
        "no equivalent: jarl reads verl's parquet columns itself, with no dataset class",
        refuse,
    ),
    VerlKey(
        "data.custom_cls.name",
        "",
        "no equivalent: jarl reads verl's parquet columns itself, with no dataset class",
        refuse,
    ),
)
