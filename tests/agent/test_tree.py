"""Tree rollouts on the embedded engine with the memorised model (greedy, so every branch
replays the script): each leaf passes the chain episode's invariants, branches are served
from the prefix cache, and the per-prompt budget is never exceeded."""

import asyncio
from typing import Any

import pytest

from jax_agent_rl.agent.context import AgentContext, Budget
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.agent.tree import run_tree, tree_budget
from jax_agent_rl.config import TreeSection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, GenerateResult
from jax_agent_rl.tokenization.tool_calls import make_parser
from tests.agent.test_loop import CONFIG

CHATML = pytest.mark.parametrize("setup", ["chatml"], indirect=True)
QUESTION = "What is 17 + 25?"  # a calculator call, then the answer


class OneAtATime:
    """Serves one request at a time through a real embedded backend, and records each with
    the prompt tokens it prefilled and those it found in the prefix cache."""

    def __init__(self, backend: EmbeddedBackend) -> None:
        self.backend = backend
        self.capabilities = backend.capabilities
        self.log: list[tuple[GenerateRequest, GenerateResult, int, int]] = []
        self._lock = asyncio.Lock()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        async with self._lock:
            stats = self.backend.stats
            before = stats.prefilled_tokens, stats.prefix_hit_tokens
            result = await self.backend.generate(request)
            prefilled = stats.prefilled_tokens - before[0]
            hit = stats.prefix_hit_tokens - before[1]
        self.log.append((request, result, prefilled, hit))
        return result

    async def update_weights(self, params: Any, version: int) -> None:
        await self.backend.update_weights(params, version)

    async def abort(self, request_id: str) -> None:
        await self.backend.abort(request_id)

    async def close(self) -> None:
        await self.backend.close()


def _grow(
    setup: dict[str, Any], tree: TreeSection, budget: Budget, question: str = QUESTION
) -> tuple[list[Trajectory], OneAtATime]:
    backend = OneAtATime(EmbeddedBackend(setup["engine"], setup["weights"]))

    async def go() -> list[Trajectory]:
        ctx = await AgentContext.create(
            backend, setup["tokenizer"], setup["tools"], make_parser(setup["parser"]), CONFIG
        )
        sample = Sample(uid="p", messages=[{"role": "user", "content": question}], group_id="p")
        try:
            return await run_tree(sample, ctx, tree, budget)
        finally:
            await backend.close()

    return asyncio.run(go()), backend


def _requests_of(
    leaf: Trajectory, leaves: dict[str, Trajectory], log: list[Any]
) -> list[tuple[GenerateRequest, GenerateResult]]:
    """The requests that built ``leaf``: its own session's, and those of the episodes it was
    copied from up to where it was copied (the response length then)."""
    mine = [(r, res) for r, res, _, _ in log if r.session_id == leaf.uid]
    traj = leaf
    while traj.forked_from is not None:
        end = len(leaf.prompt_ids) + traj.forked_tokens
        traj = leaves[traj.forked_from]
        mine += [
            (r, res)
            for r, res, _, _ in log
            if r.session_id == traj.uid and len(r.prompt_ids) + len(res.token_ids) <= end
        ]
    return sorted(mine, key=lambda e: len(e[0].prompt_ids))


@CHATML
def test_every_leaf_is_token_exact_and_branches_reuse_the_cached_prefix(
    setup: dict[str, Any],
) -> None:
    budget = Budget(model_tokens=10_000, tool_calls=100)
    leaves, backend = _grow(setup, TreeSection(n_roots=2, branch=3, depth=1), budget)
    ids, mask = setup["expected"][QUESTION]
    # 2 roots, each branching once into itself and 2 copies after its tool observation
    assert [t.uid for t in leaves] == ["p/0", "p/0.1.1", "p/0.1.2", "p/1", "p/1.1.1", "p/1.1.2"]
    by_uid = {t.uid: t for t in leaves}
    for leaf in leaves:
        # the chain episode's invariants (tests/agent/test_loop.py), over the requests of
        # the leaf's session and, up to the branch point, of those it was copied from
        assert leaf.prompt_ids + leaf.response_ids == ids, leaf.uid
        assert [0] * len(leaf.prompt_ids) + leaf.loss_mask == mask
        assert leaf.stop_reason == "eos" and leaf.num_turns == 2 and leaf.tool_calls == 1
        full = leaf.prompt_ids + leaf.response_ids
        requests = _requests_of(leaf, by_uid, backend.log)
        last_request, last_result = requests[-1]
        assert full == [*last_request.prompt_ids, *last_result.token_ids]
        sampled: list[int] = []
        lps: list[float] = []
        for request, result in requests:
            n = len(request.prompt_ids)
            assert full[: n + len(result.token_ids)] == [*request.prompt_ids, *result.token_ids]
            sampled += result.token_ids
            lps += result.logprobs or ()
        assert [t for t, m in zip(leaf.response_ids, leaf.loss_mask, strict=True) if m] == sampled
        assert [lp for lp, m in zip(leaf.rollout_logprobs, leaf.loss_mask, strict=True) if m] == lps
    # a copy's first request starts from the cached conversation of the one it was copied
    # from: only one prompt token is prefilled (the engine always prefills the last one)
    copies = [t.uid for t in leaves if t.forked_from is not None]
    firsts = [next(e for e in backend.log if e[0].session_id == uid) for uid in copies]
    assert len(firsts) == 4
    for request, _, prefilled, hit in firsts:
        assert request.prefix_session is not None
        assert prefilled == 1 and hit == len(request.prompt_ids) - 1
    # every model token and tool call is counted once, by the leaf that sampled or made it
    assert sum(t.own_model_tokens for t in leaves) == budget.used_tokens
    assert budget.used_tokens == sum(len(r.token_ids) for _, r, _, _ in backend.log)
    assert sum(t.own_tool_calls for t in leaves) == budget.used_calls == 2


@CHATML
@pytest.mark.parametrize("tokens,calls", [(30, 100), (10_000, 1), (45, 2)])
def test_the_budget_is_never_exceeded(setup: dict[str, Any], tokens: int, calls: int) -> None:
    budget = Budget(model_tokens=tokens, tool_calls=calls)
    leaves, backend = _grow(setup, TreeSection(n_roots=3, branch=2, depth=2), budget)
    used = sum(len(r.token_ids) for _, r, _, _ in backend.log)
    assert used == budget.used_tokens == sum(t.own_model_tokens for t in leaves) <= tokens
    assert sum(t.own_tool_calls for t in leaves) == budget.used_calls <= calls
    assert all(r.sampling.max_tokens > 0 for r, _, _, _ in backend.log)
    assert any(t.stop_reason == "budget" for t in leaves)  # it did bind
    for leaf in leaves:  # a cut leaf is still a whole, consistent trajectory
        assert len(leaf.response_ids) == len(leaf.loss_mask) == len(leaf.rollout_logprobs)


@CHATML
def test_a_tree_without_branching_is_the_chain_episode(setup: dict[str, Any]) -> None:
    """depth 0: n_roots independent episodes, each token for token the loop's own."""
    leaves, _ = _grow(setup, TreeSection(n_roots=2, branch=2, depth=0), Budget(10_000, 100))
    backend = EmbeddedBackend(setup["engine"], setup["weights"])

    async def chain() -> Trajectory:
        ctx = await AgentContext.create(
            backend, setup["tokenizer"], setup["tools"], make_parser(setup["parser"]), CONFIG
        )
        sample = Sample(uid="p/0", messages=[{"role": "user", "content": QUESTION}])
        try:
            return await run_sample(sample, ctx)
        finally:
            await backend.close()

    reference = asyncio.run(chain())
    assert len(leaves) == 2
    for leaf in leaves:
        assert leaf.response_ids == reference.response_ids
        assert leaf.loss_mask == reference.loss_mask
        assert leaf.stop_reason == reference.stop_reason


def test_a_tree_budget_defaults_to_that_of_n_chain_episodes() -> None:
    assert tree_budget(TreeSection(), 8, 128, 4) == Budget(8 * 128, 8 * 4)
    assert tree_budget(TreeSection(model_tokens=100, tool_calls=3), 8, 128, 4) == Budget(100, 3)


def test_a_budget_reserves_waits_for_what_is_given_back_and_is_then_spent() -> None:
    async def scenario() -> list[int]:
        budget = Budget(model_tokens=10, tool_calls=2)
        got = [await budget.reserve(8), await budget.reserve(8)]  # 8, then the last 2
        waiting = asyncio.create_task(budget.reserve(5))  # all 10 are reserved: it waits
        await asyncio.sleep(0)
        assert not waiting.done() and not budget.spent
        await budget.settle(8, 3)  # 5 given back
        got.append(await asyncio.wait_for(waiting, timeout=60))
        await budget.settle(2, 2)
        await budget.settle(5, 5)
        assert budget.spent and budget.used_tokens == 10
        got.append(await budget.reserve(1))
        assert budget.take_calls(2) and not budget.take_calls(1) and budget.used_calls == 2
        return got

    assert asyncio.run(scenario()) == [8, 2, 5, 0]
