"""A rollout function of one's own (rollout.agentic.rollout_fn) for the tests that train with one: two_turns.py's
`TwoTurnArithmetic` written out by hand on `ctx.generate`. The policy answers, a tool message repeats the question (on
a new line), the policy answers again; the reward is the arithmetic verifier's best over both answers. `SAMPLED`
records what the engine returned for each trajectory, for the test to check training against."""

from megatron_armor.agentic.driver import RolloutContext
from megatron_armor.agentic.render import ChatRenderer
from megatron_armor.agentic.trajectory import Status, Trajectory, TrajectoryBuilder, TrajectoryStats
from megatron_armor.rewards.arithmetic import verify

SAMPLED = []  # per trajectory: (its tokens, [(a turn's sampled token ids, their logprobs)] in turn order)


async def two_turns(ctx: RolloutContext, row: dict) -> Trajectory:
    renderer = ChatRenderer(ctx.tokenizer, ctx.sampling.stop_token_ids)
    messages = [{"role": "user", "content": row["prompt"]}]
    builder, stats, turns = TrajectoryBuilder(renderer.ids(messages, generation_prompt=True)), TrajectoryStats(), []
    for turn in range(2):
        sampled = await ctx.generate(builder.prompt)
        builder.add_sampled(sampled.token_ids, sampled.logprobs, sampled.versions)
        turns.append((list(sampled.token_ids), list(sampled.logprobs)))
        messages.append(renderer.assistant_message(sampled.token_ids))
        stats.turns += 1
        if turn == 0:
            new = [{"role": "tool", "content": "\n" + row["prompt"]}]
            messages += new
            stats.tool_calls += 1
            builder.add_context(renderer.continuation(sampled.token_ids, new),
                                renderer.ids(messages, generation_prompt=True))
    segments = builder.trained_segments()
    SAMPLED.append((segments[0].token_ids, turns))
    reward = max(verify(m["content"], row)[0] for m in messages if m["role"] == "assistant")
    return Trajectory(row, segments, Status.COMPLETED, reward, [], messages, stats)
